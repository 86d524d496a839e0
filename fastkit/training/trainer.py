"""``ZeroSyncSFTTrainer``: TRL's ``SFTTrainer`` without a host-device sync between log points; ``FastSFTTrainer``:
it as a fastkit trainer (:class:`fastkit.training.base.FastTrainerMixin`), what :func:`fastkit.make_trainer` returns.

What it replaces. Per optimizer step, transformers 5.24 and TRL 1.16 read device values back even on
steps that log nothing: ``_run_epoch``'s NaN/Inf loss filter (``torch.isnan(loss) or torch.isinf(loss)``:
two ``is_nonzero``), and ``SFTTrainer.compute_loss``'s metrics (``if num_valid > 0`` twice, entropy and
token accuracy ``.item()``, the token count ``.item()``). On a GPU each read drains the queue the host
had filled ahead, so the next step starts cold.

What this does instead. The same values are computed on the device and kept there: the per-micro-batch
entropy / accuracy / aux-loss as 0-d tensors (``torch.where(num_valid > 0, ...)`` for the branch), the
token count as a device sum (or a host int where TRL's count is a shape: padding-free batches on one
process), and the loss filter as ``torch.where(isfinite(loss), loss, tr_loss / n)`` returned to the
loop (with ``args.logging_nan_inf_filter`` set aside during ``train`` so the loop's own check does not
run). ``log`` reads everything pending in one non-blocking copy and hands TRL's ``log`` the same Python
floats it would have appended, in the same order, so every logged value is the same.

What must not change. The loss and its gradient (the loss code is TRL 1.16's default path, line for
line); every logged value at every log step (``tests/test_zero_sync_trainer.py`` compares the whole
``log_history`` against ``trl.SFTTrainer`` on a twin); evaluation (delegated to TRL unchanged). Paths
this class does not cover (``compute_loss_func``, label smoothing, DeepSpeed sequence parallelism) run
TRL's ``compute_loss`` unchanged, syncs included. What stays: reads at log points (the Trainer's
``tr_loss.item()`` and ``grad_norm.item()`` plus this class's one copy), fp16's ``GradScaler.step``
(``found_inf`` decides on the host whether to skip the optimizer step: a real GPU sync, only with
``fp16=True``), and host-side reads that are not device reads on a GPU either (docs/step.md).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from trl import SFTTrainer

from fastkit import _hf
from fastkit.dashboard import MetricsCallback, dashboard_callback
from fastkit.errors import FastkitError
from fastkit.patching import active_patches, unwrap
from fastkit.training.base import FastTrainerMixin
from fastkit.training.options import default_eval_steps
from fastkit.training.session import planned_steps

logger = logging.getLogger(__name__)

_METRICS = ("entropy", "mean_token_accuracy", "aux_loss")


def host_values(values: list[torch.Tensor]) -> list[float]:
    """Python floats of 0-d tensors in one copy: stacked as float64 (exact for fp32 values and int64
    counts below 2**53), copied without blocking, then one wait (an event on CUDA; nothing on the CPU)."""
    if not values:
        return []
    stacked = torch.stack([v.detach().reshape(()).to(torch.float64) for v in values])  # (N,)
    if stacked.device.type == "cpu":
        return stacked.tolist()
    host = stacked.to("cpu", non_blocking=True)  # D2H into pinned memory, queued behind the step's kernels
    done = torch.cuda.Event() if stacked.device.type == "cuda" else None
    if done is not None:
        done.record()
        done.synchronize()
    else:
        torch.accelerator.synchronize()
    return host.tolist()


class ZeroSyncSFTTrainer(SFTTrainer):
    """``trl.SFTTrainer`` with the same arguments and the same logs, and no device read between log points."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._nan_inf_filter = bool(self.args.logging_nan_inf_filter)
        self._pending: dict[str, list[torch.Tensor]] = {k: [] for k in _METRICS}  # 0-d, in TRL's append order
        self._pending_tokens: list[torch.Tensor] = []  # device token counts TRL would have read per batch

    # -- the loop ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _loop_filter_off(self):
        """The loop's own NaN/Inf check syncs twice a step; :meth:`training_step` applies it on the device."""
        self.args.logging_nan_inf_filter = False
        try:
            yield
        finally:
            self.args.logging_nan_inf_filter = self._nan_inf_filter

    def train(self, *args, **kwargs):
        with self._loop_filter_off():
            try:
                return super().train(*args, **kwargs)
            finally:
                self.flush_metrics()

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not self._nan_inf_filter:
            return loss
        # What _run_epoch adds for a NaN/Inf loss: the mean of the losses since the last log.
        tr_loss = _hf.trainer_loss_accumulator(self)
        fallback = tr_loss / _hf.steps_since_log(self)
        return torch.where(torch.isfinite(loss), loss, fallback.to(loss.dtype))

    def evaluate(self, *args, **kwargs):
        self.flush_metrics()  # TRL's eval compute_loss logs the running token count
        self.args.logging_nan_inf_filter = self._nan_inf_filter  # evaluation_loop filters with it too
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            if self.is_in_train:
                self.args.logging_nan_inf_filter = False

    # -- the loss ----------------------------------------------------------------------------------------
    def _covered(self, model) -> bool:
        if not model.training or self.compute_loss_func is not None:
            return False
        if self.label_smoother is not None and self.args.loss_type == "nll":
            return False
        pc = getattr(self.accelerator, "parallelism_config", None)
        return not (pc is not None and getattr(pc, "sp_backend", None) == "deepspeed" and pc.sp_enabled)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs or not self._covered(model):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        # TRL 1.16 SFTTrainer.compute_loss, default path, without its reads.
        inputs["use_cache"] = False
        if self.aux_loss_enabled:
            inputs["output_router_logits"] = True
        outputs = model(**inputs, fused_lm_head=True)
        per_token_loss = -outputs.log_probs  # zero on ignored positions
        if self.args.loss_type == "dft":
            per_token_loss = per_token_loss * outputs.log_probs.exp().detach()
        num_tokens = outputs.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
        loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        if self.aux_loss_enabled:
            steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / steps
        self._keep_metrics(inputs, outputs)
        return loss

    def _keep_metrics(self, inputs, outputs) -> None:
        gather = self.accelerator.gather_for_metrics
        num_valid = gather(outputs.label_mask.sum()).sum()
        entropy_sum = gather(outputs.entropy.detach().sum()).sum()
        num_correct = gather(outputs.is_top1.sum()).sum()
        some = num_valid > 0  # TRL's `if num_valid > 0`, as a device bool
        zero = torch.zeros((), device=num_valid.device)
        self._defer("entropy", torch.where(some, entropy_sum / num_valid, zero))
        self._defer("mean_token_accuracy", torch.where(some, num_correct / num_valid, zero))
        self._count_tokens(inputs)
        if self.aux_loss_enabled:
            self._defer("aux_loss", gather(outputs.aux_loss.detach()).mean())

    def _defer(self, key: str, value: torch.Tensor) -> None:
        self._pending[key].append(value)

    def _count_tokens(self, inputs) -> None:
        tp = _hf.sft_tp_size(self)
        if "attention_mask" in inputs:
            count = self.accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum()
        elif "position_ids" in inputs:
            width = inputs["position_ids"].size(1)
            if self.accelerator.num_processes == 1:  # TRL's count is a shape here: stays on the host
                total = _hf.sft_token_total(self) + width // tp
                _hf.set_sft_token_total(self, total)
                _hf.sft_metrics(self)["train"]["num_tokens"] = [total]
                return
            count = self.accelerator.gather_for_metrics(torch.tensor(width, device=inputs["position_ids"].device)).sum()
        else:
            raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
        self._pending_tokens.append(torch.div(count, tp, rounding_mode="floor"))

    # -- the log -----------------------------------------------------------------------------------------
    def flush_metrics(self) -> None:
        """Read every pending metric (one copy) into TRL's metric lists, as TRL would have appended them."""
        tokens = self._pending_tokens
        if not tokens and not any(self._pending.values()):
            return
        values = host_values([v for k in _METRICS for v in self._pending[k]] + tokens)
        metrics = _hf.sft_metrics(self)["train"]
        at = 0
        for key in _METRICS:
            n = len(self._pending[key])
            if n:  # (metrics is a defaultdict: never create an empty list, TRL averages every key)
                metrics[key].extend(values[at:at + n])
            at += n
        if tokens:
            total = _hf.sft_token_total(self) + sum(int(v) for v in values[at:])
            _hf.set_sft_token_total(self, total)
            metrics["num_tokens"] = [total]
        self._pending = {k: [] for k in _METRICS}
        self._pending_tokens = []

    def log(self, logs, start_time=None):
        self.flush_metrics()
        super().log(logs, start_time)


class FastSFTTrainer(FastTrainerMixin, ZeroSyncSFTTrainer):
    """:func:`fastkit.training.make_trainer`'s trainer: the zero-sync SFT step, made with a
    :class:`~fastkit.training.record.RunRecord` whose options are a :class:`~fastkit.training.options.TrainOptions`.

    Its finishing: an ``epochs`` run's step counts (known once the rows are packed); for text rows, the collator
    carries the packed documents' lengths (the packing patch reads them on the host) and the host token ids (host
    weights), the loss is fastkit's chunked cross-entropy where asked (default: off CUDA), and the step is compiled
    as ``options.compile`` says (:mod:`fastkit.training.compile`). A vision-language
    model's rows are collated by its processor, as they come."""

    def finish(self) -> None:
        from fastkit.data.vision import is_processor

        self._epoch_steps()
        if not is_processor(self.processing_class):
            self._attach_packed_metadata()
            self._route_loss(self._host_weights(self.run_record.options.chunked_loss))
        self._compile()

    def _compile(self) -> None:
        """``options.compile`` (after every patch and the loss routing: what compiles is the step that runs)."""
        from fastkit.training.compile import backend_and_mode, compile_model

        options = self.run_record.options
        compile_model(self.model, options.compile, *backend_and_mode(options.sft))

    def dashboard(self) -> MetricsCallback:
        record = self.run_record
        return dashboard_callback(record.options.dashboard, examples=record.examples,
                                  measure_syncs=record.options.measure_syncs, log_every_step=record.log_every_step)

    def _epoch_steps(self) -> None:
        """An ``epochs`` run's step counts that depend on its length (known once the trainer holds the rows)."""
        options = self.run_record.options
        if options.epochs is None:
            return
        total = planned_steps(self)
        self.args.warmup_steps = options.warmup_steps if options.warmup_steps is not None else min(5, total // 10)
        if self.eval_dataset is not None and options.eval_steps is None:
            self.args.eval_steps = default_eval_steps(total)

    def _attach_packed_metadata(self) -> None:
        """Let the packing patch see host-side document lengths (the Trainer moves tensors to the device)."""
        if "packing" not in active_patches(unwrap(self.model)):
            return
        from fastkit.patches.packing.patch import wrap_collator

        self.data_collator = wrap_collator(self.data_collator)

    def _host_weights(self, chunked_loss: bool | None) -> bool | None:
        """Host weights (:mod:`fastkit.patches.host`): the collator carries the host token ids for the embedding,
        and a host lm_head needs fastkit's chunked loss (TRL's kernel reads the head on the device)."""
        from fastkit.patches.host import HOST_EMBEDDING, HOST_LM_HEAD, wrap_collator

        active = active_patches(unwrap(self.model))
        if HOST_EMBEDDING in active:
            self.data_collator = wrap_collator(self.data_collator)
        if HOST_LM_HEAD not in active:
            return chunked_loss
        if chunked_loss is False:
            raise FastkitError("chunked_loss=False, but the lm_head is kept on the host (HostWeights(lm_head=True)): "
                               "only fastkit's chunked loss streams it. Drop chunked_loss=False, or keep the head on "
                               "the GPU (get_peft_model(host_weights=fastkit.HostWeights(lm_head=False))).")
        return True

    def _route_loss(self, chunked_loss: bool | None) -> None:
        """fastkit's chunked loss where asked (default: off CUDA), else TRL's fused LM head."""
        if not (chunked_loss if chunked_loss is not None else self.model.device.type != "cuda"):
            return
        from fastkit.patches.loss.patch import route_trainer_loss

        ok, how = route_trainer_loss(self)
        if not ok and chunked_loss is True and "host_lm_head" in active_patches(unwrap(self.model)):
            raise FastkitError(f"The lm_head is kept on the host, but fastkit's chunked loss (which streams it) "
                               f"cannot apply: {how}. Keep the head on the GPU (get_peft_model(host_weights="
                               "fastkit.HostWeights(lm_head=False))).")
        if not ok:
            logger.info("fastkit: chunked loss not used (%s); TRL's fused LM head computes the loss", how)


__all__ = ["FastSFTTrainer", "ZeroSyncSFTTrainer", "host_values"]
