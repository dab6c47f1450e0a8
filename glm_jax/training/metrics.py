"""A training run's progress: `MetricsLog` (the progress bar and lines on stdout, one JSON
record per logged step in metrics.jsonl), `drop_records_after` (a resumed run's file cut back
to the step it continues from) and `memory_in_use`."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from glm_jax.extras import require

tqdm = require("tqdm").tqdm       # the train extra

from glm_jax import costs, multihost  # noqa: E402 (after the check)
from glm_jax.config import GLMConfig  # noqa: E402
from glm_jax.model import abstract_model, params_by_part  # noqa: E402
from glm_jax.training.compiles import CompileWatch  # noqa: E402
from glm_jax.training.run_config import TrainConfig  # noqa: E402

# Dense bf16 peak FLOP/s by device kind (vendor figures), for MFU.
_PEAK_FLOPS = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12, "TPU v5p": 459e12, "TPU v6e": 918e12,
               "TPU v5 lite": 197e12}


def drop_records_after(path: Path, step: int) -> int:
    """Rewrite the metrics file without the records of steps after `step` (written by a run
    that stopped before it could save them, and run again from `step` by this one) and without a
    line cut short by a crash -> the number of lines dropped."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if isinstance(record, dict) and record.get("step", 0) > step:
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
    return dropped


class MetricsLog:
    """The progress lines on stdout and one JSON object per logged step in --metrics-file
    (process 0 only): loss terms, lr, tokens/s (whole rows; real: without the packer's padding,
    summed over the processes) since the last logged step, MFU when the peak is known."""

    def __init__(self, settings: TrainConfig, cfg: GLMConfig, out: Path, start: int = 0,
                 compiles: CompileWatch | None = None):
        self.steps, self.seq_len = settings.schedule.steps, settings.data.seq_len
        self.compiles = compiles
        self.steady = []        # tokens/s of the logged intervals in which nothing compiled
        self.start, self.t_start = start, time.perf_counter()
        # The bar (stderr, a terminal only): step, elapsed and time left, s/step, loss, memory.
        self.bar = tqdm(total=self.steps, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr,
                        disable=None if multihost.is_main_process() else True, leave=False)
        self.cfg = cfg
        path = Path(settings.logging.metrics_file or out / "metrics.jsonl")
        if multihost.is_main_process():     # from step 0 too: a resume that found no complete checkpoint
            drop_records_after(path, start)
        self.file = path.open("a") if multihost.is_main_process() else open(os.devnull, "w")
        self.peak = _peak_flops(settings.logging.peak_tflops)
        self.active = costs.active_params(cfg, params_by_part(abstract_model(cfg)))
        self.tokens_per_step = settings.data.batch_size * self.seq_len
        self.t_last = time.perf_counter()
        self.steps_since = self.real_since = 0  # since the last logged step; real: this process's non-padding tokens

    def step(self, step: int, stage: str, lr: Callable[[], float], terms: dict, batch, *, full: bool) -> dict:
        """The record of a step; `full`: with its learning rate (`lr()`), loss terms and speed,
        printed. Every process must call it (a full record gathers the tokens of every process).
        Only a full record reads anything back from the device."""
        self.steps_since += 1
        self.real_since += int(batch.loss_mask.sum())
        self.bar.update(1)
        record = {"step": step, "stage": stage}
        if not full:
            return record
        record["lr"] = lr()
        record.update({k: float(v) for k, v in terms.items()})
        now = time.perf_counter()
        record["tokens_per_s"] = self.tokens_per_step * self.steps_since / (now - self.t_last)
        record["real_tokens_per_s"] = sum(multihost.allgather_json(self.real_since)) / (now - self.t_last)
        self.steps_since = self.real_since = 0
        built, compile_s = self.compiles.since_last() if self.compiles else (0, 0.0)
        if built:
            record["compiled"], record["compile_s"] = built, compile_s
        else:
            self.steady.append(record["tokens_per_s"])
        flops = costs.training_flops_per_token(self.cfg, self.seq_len, self.active, sparse=stage == "sparse",
                                               positions=batch.positions)
        if self.peak:
            record["mfu"] = record["tokens_per_s"] * flops / self.peak
        self.t_last = now
        per_step = (now - self.t_start) / max(step - self.start, 1)
        record["memory_gib"] = memory_in_use() / 2**30
        self.bar.set_postfix_str(f"loss {record['loss']:.3f}, {record['memory_gib']:.1f} GiB", refresh=False)
        tqdm.write(f"step {step:5d}/{self.steps} [{stage}] loss {record['loss']:.3f} lm {record['lm']:.3f} "
                   f"idx_kl {record['indexer_kl']:.3f} mtp {record.get('mtp', 0):.3f} "
                   f"lr {record['lr']:.2e} {record['tokens_per_s']:.0f} tok/s "
                   f"({record['real_tokens_per_s']:.0f} not padding)"
                   + (f" MFU {record['mfu']:.1%}" if "mfu" in record else "")
                   + f" | {per_step:.2f} s/step, {_clock((self.steps - step) * per_step)} left, "
                     f"{record['memory_gib']:.2f} GiB"
                   + (f" | compiled {built} program(s) in {compile_s:.1f} s" if built else ""), file=sys.stdout)
        sys.stdout.flush()
        return record

    def validation(self, record: dict, val: float) -> None:
        record["val_lm"] = val
        tqdm.write(f"step {record['step']:5d} validation lm loss {val:.3f} (held-out files)", file=sys.stdout)
        sys.stdout.flush()

    def write(self, record: dict) -> None:
        """Writes a record that holds more than step and stage."""
        if len(record) > 2:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        if self.compiles is not None:
            steady = (f"steady {np.median(self.steady):,.0f} tokens/s (median of {len(self.steady)} logged "
                      "intervals without compilation)" if self.steady else "no logged interval without compilation")
            print(f"compiled: {self.compiles.summary(always=('jit(train_step)',))}; {steady}", flush=True)


def _peak_flops(peak_tflops: float | None) -> float | None:
    if peak_tflops:
        return peak_tflops * 1e12
    return _PEAK_FLOPS.get(jax.devices()[0].device_kind)


def memory_in_use() -> int:
    """Bytes in use at the peak so far: the first local accelerator's allocator peak where it
    reports one (GPU, TPU), else this process's peak resident memory (CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024       # KiB on Linux


def _clock(seconds: float) -> str:
    """Seconds as h:mm:ss."""
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
