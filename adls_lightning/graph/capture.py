"""Capture a model's forward as a ``torch.fx.GraphModule`` with ``torch.export`` (Lab 0's "trace to a graph").

The course framework traced Hugging Face models with ``transformers.utils.fx.HFTracer``, which transformers 5
removed. ``torch.export`` is what current PyTorch offers instead: it runs the model once on example inputs (non-strict
mode: plain Python, no bytecode capture) and records every ATen operator it reaches. ``ExportedProgram.module()``
turns the result back into a ``GraphModule`` whose ``forward`` takes the same keyword inputs as the model and whose
parameters are ``get_attr`` nodes, so passes are ordinary ``torch.fx.Graph`` code.

What follows from recording ATen operators (unlike the HF tracer, which kept ``nn.Linear`` etc. as ``call_module``
leaves): every layer is inlined to ``call_function`` nodes (``aten.linear``, ``aten.dropout``, ...); the module a node
came from is kept in ``node.meta["nn_module_stack"]`` (see :func:`module_path`). Python control flow is resolved for
the example inputs, so which inputs are given (``input_names``) changes the graph: that is Lab 0's topology question.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.fx import GraphModule, Node

# The inputs a Hugging Face sequence classifier takes, as the lab's ``hf_input_names``.
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids", "labels")
DEFAULT_INPUT_NAMES = ("input_ids", "attention_mask")
# Where capture() keeps the inputs it traced with, for analysis passes that run the graph (report).
EXAMPLE_INPUTS_KEY = "example_inputs"


def example_inputs(
    input_names: Sequence[str],
    *,
    vocab_size: int,
    batch_size: int = 2,
    seq_len: int = 16,
    num_labels: int = 2,
    seed: int = 0,
) -> dict[str, Tensor]:
    """Random inputs for a sequence classifier, one tensor per name (the second sequence half padded).

    Raises:
        ValueError: a name outside :data:`INPUT_NAMES`, or ``input_ids`` missing.
    """
    check_input_names(input_names)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    attention_mask[1:, seq_len // 2 :] = 0
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "token_type_ids": torch.zeros(batch_size, seq_len, dtype=torch.long),
        "labels": torch.randint(0, num_labels, (batch_size,), generator=generator),
    }
    return {name: tensors[name] for name in input_names}


def check_input_names(input_names: Sequence[str]) -> None:
    """Raise ValueError unless ``input_names`` are distinct names from :data:`INPUT_NAMES` including input_ids."""
    unknown = [name for name in input_names if name not in INPUT_NAMES]
    if unknown:
        raise ValueError(f"unknown input name {unknown[0]!r} (valid: {', '.join(INPUT_NAMES)})")
    if "input_ids" not in input_names:
        raise ValueError(f"input_ids must be among the traced inputs (got {list(input_names)})")
    if len(set(input_names)) != len(input_names):
        raise ValueError(f"input names repeat: {list(input_names)}")


def _vocab_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    if config is None or getattr(config, "vocab_size", None) is None:
        raise ValueError(f"{type(model).__name__} has no config.vocab_size: pass example_inputs yourself")
    return int(config.vocab_size)


def capture(
    model: nn.Module,
    input_names: Sequence[str] = DEFAULT_INPUT_NAMES,
    *,
    inputs: Mapping[str, Tensor] | None = None,
    dynamic: bool = False,
    batch_size: int = 2,
    seq_len: int = 16,
) -> GraphModule:
    """The forward of ``model`` on the keyword inputs ``input_names``, as a ``torch.fx.GraphModule``.

    The returned module is called like the model (``gm(input_ids=..., attention_mask=...)``) and returns what the
    model returns (a ``SequenceClassifierOutput`` for Hugging Face classifiers). It shares the model's parameter
    tensors. The model's current mode is traced: in ``train()`` mode dropout nodes have ``train=True``.

    Args:
        model: any ``nn.Module`` whose forward takes these keyword inputs.
        input_names: which inputs are traced (the lab's ``hf_input_names``); the others take their defaults.
        inputs: example tensors by name; by default random ones from :func:`example_inputs` (needs
            ``model.config.vocab_size``).
        dynamic: batch and sequence length as symbolic sizes (``torch.export.Dim.AUTO``), so the graph runs on
            other shapes; otherwise the graph is specialised to the example shapes.
        batch_size, seq_len: shape of the default example inputs.

    Raises:
        ValueError: an unknown input name, or an ``inputs`` mapping that lacks one.
        torch._dynamo.exc.UserError, torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode, ...:
            what torch.export raises for a forward it cannot follow (see docs/graph.md).
    """
    input_names = list(input_names)
    if inputs is None:
        num_labels = int(getattr(getattr(model, "config", None), "num_labels", 2) or 2)
        inputs = example_inputs(
            input_names,
            vocab_size=_vocab_size(model),
            batch_size=batch_size,
            seq_len=seq_len,
            num_labels=num_labels,
        )
    missing = [name for name in input_names if name not in inputs]
    if missing:
        raise ValueError(f"no example tensor for input {missing[0]!r} (inputs has {sorted(inputs)})")
    kwargs = {name: inputs[name] for name in input_names}
    dynamic_shapes = None
    if dynamic:
        dynamic_shapes = {
            name: {dim: torch.export.Dim.AUTO for dim in range(tensor.dim())}
            for name, tensor in kwargs.items()
        }
    program = torch.export.export(model, (), kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    # Input checks (shapes, dtypes) as a forward pre-hook rather than a `_guards_fn` call_module node, which
    # would be one more box in every picture and diff without being part of the model.
    graph_module = program.module(check_guards=False)
    graph_module.meta[EXAMPLE_INPUTS_KEY] = kwargs
    return graph_module


def module_path(node: Node) -> str:
    """Dotted path of the innermost module a node was recorded in (``bert.encoder.layer.0.output.dropout``);
    ``""`` for the top level and for nodes without that record (placeholders, get_attr, output)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path, _type = list(stack.values())[-1]
    return path


def module_type(node: Node) -> str:
    """Class name of the innermost module a node was recorded in (``Dropout``), ``""`` when unknown."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    _path, type_name = list(stack.values())[-1]
    return str(type_name).rsplit(".", 1)[-1]
