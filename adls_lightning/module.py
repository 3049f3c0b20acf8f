"""The LightningModule: a Hugging Face sequence classifier, optionally wrapped with PEFT LoRA."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from lightning import LightningModule
from peft import LoraConfig, PeftModel, get_peft_model
from torchmetrics import MetricCollection
from transformers import PreTrainedModel

from adls_lightning.checkpoints import (
    LIGHT_KEY,
    RESOLVED_KEY,
    complete_light_state,
    frozen_base_digests,
    light_state,
    lora_mismatch,
    read_checkpoint,
)
from adls_lightning.data.tasks import REGRESSION_BIAS_INITS, build_metric, scored_predictions
from adls_lightning.dropout import use_fast_dropout
from adls_lightning.errors import ConfigError, require_choice
from adls_lightning.lora import check_lora_targets
from adls_lightning.lora import merge_lora as merge_lora_into_base
from adls_lightning.models import is_task_head_key, set_attn_implementation, without_task_head
from adls_lightning.precision import bf16_inference_model
from adls_lightning.precision import eval_precision as resolve_eval_precision

log = logging.getLogger(__name__)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def parameter_metrics(model: torch.nn.Module) -> dict[str, int]:
    """``params/trainable``, ``params/total`` and ``model/lora_params`` (LoRA adapter weights still in the model:
    0 once they are merged into the base weights), logged once."""
    trainable, total = count_parameters(model)
    lora = sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)
    log.info(
        "Parameters: %s trainable of %s (%.2f%%)", f"{trainable:,}", f"{total:,}", 100 * trainable / total
    )
    return {"params/trainable": trainable, "params/total": total, "model/lora_params": lora}


class SequenceClassifier(LightningModule):
    """Fine-tunes a sequence classifier; LoRA via PEFT when ``lora`` is given, full fine-tuning otherwise.

    With LoRA the base weights are frozen, adapters (B zero-initialised, PEFT's default) are added to
    ``lora.target_modules`` with the layers' biases kept, and ``lora.modules_to_save`` (the classifier head)
    is trained in full.

    Args:
        backbone: the HF model (built by ``adls_lightning.models``).
        optimizer: partial optimizer constructor, called with the trainable parameters.
        scheduler: partial ``(optimizer, num_warmup_steps, num_training_steps) -> LRScheduler`` (stepped per batch).
        lora: a ``peft.LoraConfig`` or None for full fine-tuning.
        warmup_ratio: fraction of the training steps used for linear warm-up.
        freeze_embeddings: freeze the backbone's embedding block (word, position and token-type embeddings and
            their LayerNorm) -- Tutorial 2's "full fine-tuning with the embeddings frozen" (``model/lora=none
            model.freeze_embeddings=true``); with LoRA they are frozen already.
        merge_lora_before_compress: the compression callbacks (quantization, pruning, compression-aware
            fine-tuning, MXINT8 packing) first merge the LoRA adapters into the base weights
            (:func:`adls_lightning.lora.merge_lora`), so what is compressed and deployed is one plain model, as in
            the labs. ``false`` keeps the adapters in fp32 and dense beside the compressed base layers.
        merged_lr: learning rate of the merged base weights once merged (QAT of the merged weights, the
            fine-tune after pruning); the head (``lora.modules_to_save``) keeps ``optimizer.lr``. Null: one lr.
        init_ckpt: a Lightning checkpoint whose model weights this module starts from (not its trainer state:
            epochs, optimizer and schedule start afresh), e.g. QAT or pruning of an already fine-tuned model.
            Loaded in :meth:`setup`, after the callbacks' ``setup`` has swapped quantized layers in, so both a
            full-precision and a quantized checkpoint of the same architecture load.
        init_head: with ``init_ckpt``, ``"checkpoint"`` loads all of it, its task head included; ``"new"`` loads
            all but the task head (:data:`~adls_lightning.models.TASK_HEAD_MODULES`), which keeps this
            model's fresh initialisation: intermediate-task transfer, a checkpoint of another task (another
            label count) as the start of this one.
        attn_implementation: Hugging Face attention implementation, ``sdpa`` (fused) or ``eager`` (naive);
            None keeps the backbone's.
        fast_dropout: every ``nn.Dropout`` (HF's hidden and head dropouts, PEFT's LoRA dropouts) and SDPA's
            attention-probability dropout draw their masks with the C++ Philox kernel on CPU tensors
            (:mod:`adls_lightning.dropout`); torch's dropout on other devices, or where the kernel is not built.
        label_names: the task's class names in id order, saved as the model config's ``id2label`` /
            ``label2id``; None with a one-output backbone = a regression (MSE loss). Set from the data's task.
        metrics: the task's metric names (``acc``, ``f1``, ``mcc``, ``pearson``, ``spearman``), logged as
            ``val/<name>`` and ``test/<name>``.
        test_splits: the labelled evaluation splits, one per test dataloader (MNLI: ``test``, ``test_mm``).
        light_checkpoints: a LoRA model whose frozen base was read from pretrained files checkpoints only what
            training changes (adapters, trained heads, buffers: ~6 MB with the optimizer state for MiniLM instead of
            97 MB) and completes the rest from the freshly built model when loaded
            (:func:`~adls_lightning.checkpoints.light_state`); ``false`` writes full checkpoints. A run that changes
            its base (merged LoRA, quantized or pruned base weights, an unfrozen base) writes full ones regardless.
        regression_bias_init: where a regression's new output layer starts: ``mean``, its bias at the training
            targets' mean (the data module's :meth:`train_target_mean`, set when fitting starts), so the first
            steps fit the spread, not the offset; ``zero``, the backbone's own initialisation (Hugging Face's
            zero bias). On STS-B (targets 0-5, mean 2.7) at the preset's LoRA rate of 1e-3 both starts score
            alike over seeds, and a start that collapsed from zero to a constant output (test Pearson 0.216)
            reached 0.651 from the mean (docs/glue.md). Classification and a head loaded from ``init_ckpt`` are
            left as they are.
        eval_precision: how validation and test compute (:func:`adls_lightning.precision.eval_precision`):
            ``auto`` casts the weights to bfloat16 once per evaluation pass where the run's ``trainer.precision``
            resolved to bf16 on a CPU (a bf16 copy: training keeps its fp32 weights), else evaluates as the trainer
            computes; ``bf16`` always casts; ``32-true`` evaluates in fp32 with autocast off (docs/precision.md).
    """

    def __init__(
        self,
        backbone: PreTrainedModel,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None = None,
        lora: LoraConfig | None = None,
        warmup_ratio: float = 0.1,
        freeze_embeddings: bool = False,
        merge_lora_before_compress: bool = False,
        merged_lr: float | None = None,
        init_ckpt: str | None = None,
        init_head: str = "checkpoint",
        attn_implementation: str | None = None,
        fast_dropout: bool = False,
        label_names: Sequence[str] | None = ("0", "1"),
        metrics: Sequence[str] = ("acc", "f1"),
        test_splits: Sequence[str] = ("test",),
        light_checkpoints: bool = True,
        eval_precision: str = "auto",
        regression_bias_init: str = "mean",
    ) -> None:
        super().__init__()
        if attn_implementation is not None:
            set_attn_implementation(backbone, attn_implementation)
        num_labels = backbone.config.num_labels
        if (1 if label_names is None else len(label_names)) != num_labels:
            raise ConfigError(
                f"model.backbone.num_labels={num_labels}: the task has "
                f"{'one regression output' if label_names is None else f'{len(label_names)} labels'}"
            )
        if label_names is not None:
            backbone.config.id2label = dict(enumerate(label_names))
            backbone.config.label2id = {name: i for i, name in enumerate(label_names)}
        # What HF's forward would set at the first call with labels; set now, that mutation would make
        # torch.compile recompile the model.
        backbone.config.problem_type = "regression" if label_names is None else "single_label_classification"
        self.regression = label_names is None
        # Factories are kept as attributes (not hparams): they are callables, not checkpointable values.
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.warmup_ratio = warmup_ratio
        self.init_ckpt = init_ckpt
        require_choice("init_head", init_head, ("checkpoint", "new"))
        self.init_head = init_head
        require_choice("model.regression_bias_init", regression_bias_init, REGRESSION_BIAS_INITS)
        self.regression_bias_init = regression_bias_init
        self.merge_lora_before_compress = merge_lora_before_compress
        self.merged_lr = merged_lr
        self.head_modules = tuple(lora.modules_to_save or ()) if lora is not None else ()
        self.lora_merged = False
        self._init_loaded = False
        #: ``runtime.gemm`` as the run resolved it (app.training sets it), recorded in checkpoints
        self.resolved_gemm: str | None = None
        #: knowledge distillation set by a callback (compress.distill: an ``adls_lightning.distill.Distiller``): the
        #: training loss mixes in its teacher's soft targets. A plain attribute, not a submodule: the teacher is not
        #: model state (checkpoints keep their keys) and its parameters are in no optimizer.
        self.distiller = None
        if freeze_embeddings:
            embeddings = getattr(backbone.base_model, "embeddings", None)
            if embeddings is None:
                raise ConfigError(
                    f"model.freeze_embeddings=true: {type(backbone).__name__} has no embeddings block to freeze"
                )
            embeddings.requires_grad_(False)
        if lora is not None:
            check_lora_targets(backbone, lora)
        self.model = get_peft_model(backbone, lora) if lora is not None else backbone
        if not isinstance(fast_dropout, bool):
            raise ConfigError(f"model.fast_dropout={fast_dropout!r}: must be true or false")
        if fast_dropout:
            use_fast_dropout(self.model)
        metrics = MetricCollection({name: build_metric(name, num_labels) for name in metrics})
        self.val_metrics = metrics.clone(prefix="val/")
        # one collection per test dataloader; a ModuleList so they move with the model and reset per epoch
        self.test_metrics = torch.nn.ModuleList(metrics.clone(prefix=f"{split}/") for split in test_splits)
        if not isinstance(light_checkpoints, bool):
            raise ConfigError(f"model.light_checkpoints={light_checkpoints!r}: must be true or false")
        #: where the frozen base of a LoRA model was read from (from_pretrained's path), or None: full checkpoints.
        #: A randomly initialised base (``model=tiny_*``) has no such source: a reader without the run's seed could
        #: not rebuild it.
        source = getattr(backbone.config, "_name_or_path", "") or None
        self.light_base = source if lora is not None and light_checkpoints else None
        # the frozen tensors as built: what a save finds unchanged, a fresh build of the same config gives again
        self._base_digests = frozen_base_digests(self) if self.light_base else {}
        self._base_before_merge: dict[str, torch.Tensor] | None = None
        self._init_state = self._light_init_state() if init_ckpt else None
        resolve_eval_precision(eval_precision, "32-true")  # checked now, resolved against the trainer's later
        self.eval_precision = eval_precision
        #: the model an evaluation pass runs (a bf16 copy, or self.model with autocast off); None: self(**batch)
        self._eval_model: torch.nn.Module | None = None
        self._eval_logged = False

    def _light_init_state(self) -> dict | None:
        """A light ``init_ckpt``'s state, completed now from the base as built: by :meth:`setup` the compression
        callbacks may have merged LoRA into it (it then loads through their hooks as a full checkpoint does)."""
        checkpoint = read_checkpoint(self.init_ckpt, "init_ckpt", mmap=True)
        if not checkpoint.get(LIGHT_KEY):
            return None  # a full checkpoint: read in setup
        return complete_light_state(self, checkpoint, self.init_ckpt, "init_ckpt", copy=True)

    def setup(self, stage: str) -> None:
        self._load_init_ckpt()
        if stage == "fit" and not (self.init_ckpt and self.init_head == "checkpoint"):
            self._start_regression_at_target_mean()

    def _start_regression_at_target_mean(self) -> None:
        """``regression_bias_init=mean``: the new regression head's trained output bias = the training targets'
        mean. Before any resume: a ``ckpt_path`` checkpoint loads over it."""
        if not self.regression or self.regression_bias_init != "mean":
            return
        datamodule = getattr(self._trainer, "datamodule", None)
        mean = datamodule.train_target_mean() if hasattr(datamodule, "train_target_mean") else None
        if mean is None:
            return
        # the trained copy only: PEFT keeps a frozen original of each saved module, part of the base that light
        # checkpoints leave out and check by digest
        outputs = [
            (name, module)
            for name, module in self.named_modules()
            if is_task_head_key(name)
            and isinstance(module, torch.nn.Linear)
            and module.out_features == 1
            and module.bias is not None
            and module.bias.requires_grad
        ]
        for _, module in outputs:
            with torch.no_grad():
                module.bias.fill_(mean)
        log.info(
            "Regression head: output bias starts at the training targets' mean %.4f (%s; "
            "model.regression_bias_init=zero keeps the backbone's)",
            mean,
            ", ".join(name for name, _ in outputs) or "no trainable one-output layer found: left as built",
        )

    def _load_init_ckpt(self) -> None:
        if self.init_ckpt and not self._init_loaded:
            state = self._init_state
            if state is None:
                state = read_checkpoint(self.init_ckpt, "init_ckpt", mmap=True)["state_dict"]
            self._init_state = None
            if self.init_head == "new":  # this model's own fresh head in place of the checkpoint's
                own_head = {k: v for k, v in self.state_dict().items() if is_task_head_key(k)}
                state = {**without_task_head(state), **own_head}
            # strict, with the keys that differ as one line: the usual one is a LoRA model and a full fine-tune
            # checkpoint (both directions: lora_mismatch), which the shapes checked before the run cannot tell from
            # a LoRA run's merged checkpoint
            differ = self.load_state_dict(state, strict=False)
            if differ.missing_keys or differ.unexpected_keys:
                raise ConfigError(
                    lora_mismatch(state, self.state_dict(), self.init_ckpt, "init_ckpt")
                    or f"init_ckpt={self.init_ckpt}: does not fit this model ({len(differ.missing_keys)} weights "
                    f"missing, e.g. {next(iter(differ.missing_keys), 'none')}; {len(differ.unexpected_keys)} "
                    f"unexpected, e.g. {next(iter(differ.unexpected_keys), 'none')})"
                )
            self._init_loaded = True
            new_head = (
                " (all but the task head, which is new: init_head=new)" if self.init_head == "new" else ""
            )
            log.info("Model weights initialised from %s%s", self.init_ckpt, new_head)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Record what the run resolved on its machine (:data:`RESOLVED_KEY`); leave out the frozen base
        a fresh build restores (:attr:`light_base`), when nothing changed it."""
        if self._trainer is not None:
            resolved = {"trainer.precision": str(self._trainer.precision)}
            if self.resolved_gemm is not None:
                resolved["runtime.gemm"] = self.resolved_gemm
            checkpoint[RESOLVED_KEY] = resolved
        if self.light_base is None or self.lora_merged or not isinstance(self.model, PeftModel):
            return
        light = light_state(self, checkpoint["state_dict"], self._base_digests, self.light_base)
        if light is not None:
            checkpoint["state_dict"], checkpoint[LIGHT_KEY] = light

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Complete a light checkpoint's state from this model's own base before Lightning loads it (strict):
        resume (``ckpt_path``) and the test of the best checkpoint."""
        if checkpoint.get(LIGHT_KEY):
            path = (self._trainer.ckpt_path if self._trainer is not None else None) or "checkpoint"
            checkpoint["state_dict"] = complete_light_state(
                self,
                checkpoint,
                path,
                "ckpt_path",
                base=self._base_before_merge if self.lora_merged else None,
            )

    def forward(self, input_ids, attention_mask=None, labels=None, token_type_ids=None):
        # token_type_ids only for pairs (single texts leave them out: all zeros is the models' default)
        pair = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **pair)

    def predictions(self, logits: torch.Tensor) -> torch.Tensor:
        """What the metrics score: the regression output, or the predicted class id."""
        return scored_predictions(logits, self.regression)

    def training_step(self, batch, batch_idx):
        out = self(**batch)
        loss, size = out.loss, batch["labels"].shape[0]
        if self.distiller is not None:
            loss, parts = self.distiller.loss(batch, out.logits, loss)
            self.log_dict({f"train/{name}": value for name, value in parts.items()}, batch_size=size)
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        return loss

    def _start_evaluation(self) -> None:
        """Resolve :attr:`eval_precision` against the trainer's precision and, for ``bf16``, cast the weights once
        for this pass (after the callbacks' own ``on_*_start``: the copy has what they changed)."""
        trainer_precision = str(self.trainer.precision)
        how = resolve_eval_precision(self.eval_precision, trainer_precision, self.device.type == "cpu")
        # kept out of nn.Module's registry: a registered copy would be saved in every checkpoint written during the
        # pass (ModelCheckpoint saves in on_validation_end, before this module's own hook clears it)
        self.__dict__["_eval_model"] = (
            bf16_inference_model(self.model) if how == "bf16" else self.model if how == "32-true" else None
        )
        if not self._eval_logged:
            self._eval_logged = True
            log.info(
                "Evaluation: %s (model.eval_precision=%s, trainer.precision=%s)",
                {"bf16": "weights cast to bf16 once per pass", "32-true": "fp32, autocast off"}.get(
                    how, f"as the trainer computes ({trainer_precision})"
                ),
                self.eval_precision,
                trainer_precision,
            )

    def on_validation_start(self) -> None:
        self._start_evaluation()

    def on_test_start(self) -> None:
        self._start_evaluation()

    def on_validation_end(self) -> None:
        self._eval_model = None

    def on_test_end(self) -> None:
        self._eval_model = None

    def _eval_step(self, batch, metrics: MetricCollection) -> None:
        if self._eval_model is None:
            out = self(**batch)
        else:  # its own precision: no autocast of a bf16-cast model or of an fp32 evaluation
            with torch.autocast(self.device.type, enabled=False):
                pair = {} if "token_type_ids" not in batch else {"token_type_ids": batch["token_type_ids"]}
                out = self._eval_model(
                    input_ids=batch["input_ids"],
                    attention_mask=batch.get("attention_mask"),
                    labels=batch["labels"],
                    **pair,
                )
            out.logits, out.loss = out.logits.float(), out.loss.float()
        metrics.update(self.predictions(out.logits), batch["labels"])
        prefix = metrics.prefix
        size = batch["labels"].shape[0]
        self.log(f"{prefix}loss", out.loss, batch_size=size, add_dataloader_idx=False)
        self.log_dict(metrics, prog_bar=prefix == "val/", batch_size=size, add_dataloader_idx=False)

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch, self.val_metrics)

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        self._eval_step(batch, self.test_metrics[dataloader_idx])

    def merge_lora(self) -> int:
        """Fold the LoRA adapters into the base weights now (idempotent); returns the adapter parameters merged."""
        if self.light_base and not self.lora_merged and isinstance(self.model, PeftModel):
            # a light checkpoint loaded after the merge (a PTQ evaluation of a fine-tuned run) is completed from the
            # base as built: the merge changes the adapted layers' weights in place (kept as copies), not the rest
            self._base_before_merge = {
                k: v.clone() if ".base_layer." in k else v
                for k, v in self.state_dict().items()
                if k in self._base_digests
            }
        merged = merge_lora_into_base(self)
        self.lora_merged = self.lora_merged or merged > 0
        return merged

    def _param_groups(self) -> list[dict]:
        trainable = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        if not (self.lora_merged and self.merged_lr is not None):
            return [{"params": [p for _, p in trainable]}]
        # After a merge the whole base trains: at merged_lr, the (already fully trained) head at optimizer.lr.
        is_head = [any(f".{m}." in f".{n}" for m in self.head_modules) for n, _ in trainable]
        head = [p for (_, p), h in zip(trainable, is_head) if h]
        base = [p for (_, p), h in zip(trainable, is_head) if not h]
        return [{"params": head}, {"params": base, "lr": self.merged_lr}]

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(params=self._param_groups())
        if self.scheduler_factory is None:
            return optimizer
        total = self.trainer.estimated_stepping_batches
        scheduler = self.scheduler_factory(
            optimizer, num_warmup_steps=int(self.warmup_ratio * total), num_training_steps=total
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
