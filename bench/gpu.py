"""One GPU: ``train.py`` against a plain torch loop, the input pipeline's own rate, and NCCL's recoveries.

    python -m bench.gpu                  # on a GPU machine (make bench-gpu): writes bench/results/gpu-<date>.json
    python -m bench.gpu --smoke          # anywhere, in a minute: the same steps, tiny, on the CPU (a test runs it)

1. **Step speed.** Images/s of ``train.py`` (``sync=allreduce``, one process, ``data=synthetic`` with uint8 images
   made by the loader's workers, normalized on the device one batch ahead) against a plain torch loop that trains the
   same timm model on one batch already on the device: the same batch size, precision (bfloat16 autocast where the
   GPU has it, else float16 with a GradScaler), memory format (channels_last), ``cudnn.benchmark`` and compile
   setting, one ``loss.item()`` per step as the trainer's. Both run in one invocation, on the same GPU, one after the
   other; medians over steps ``--skip`` and later. The trainer's records also give its data wait, GPU compute and
   GPU communication per step.
2. **Real images** (``--images``, an ImageNet-like tree written at bench time by ``bench.jpegs``: JPEGs of mixed
   sizes around 500x375, one in 16 CMYK, grayscale, progressive or a PNG): ``train.py`` on them (``data=imagefolder``)
   for each of ``--real-decodes`` (``gpu``: batched nvJPEG on the GPU; ``cpu``: the workers), ``real_img_s`` and
   ``real_cpu_img_s`` beside the synthetic run's ``synthetic_img_s`` (the same figure as ``ours_img_s``), with the
   same batch, steps and compile setting; the device decode path alone (``decode_img_s``: nvJPEG, crops, resizes,
   flips, normalization on collated batches, ``bench.decode``) and its agreement with the CPU decode over
   ``--agree-batches`` batches with writes queued on the stream (the nvJPEG ordering hazard); and the workers'
   loader alone on the CPU decode (``loader_img_s``): whole epochs at batch 64 once the workers have started.
3. **NCCL recoveries** (``--faults``, on by default on a GPU): ``make test-gpu``'s kill cases (three torchrun nodes,
   one killed, under allreduce, DGC and local SGD; a node lost in a ring of four), each node an NCCL host of its own
   on the shared GPU; every ``rank_lost`` event's ``recovery_s``. Beside them, the GPU tests ``--gpu-tests`` names
   (the GPU defaults, ``sync=relaxed amp=apex`` at O1 and O2, a GPU straggler evicted), with each test's outcome.
   On the CPU (``--smoke``) the cases are only collected, so that a renamed test fails here and not on the next
   GPU.

Writes ``bench/results/gpu-<date>.json`` (``device``, ``torch``, ``nccl``, ``cpus``, ``ours_img_s``,
``plain_img_s``, ``ratio``, ``synthetic_img_s``, ``real_img_s``, ``decode_img_s``, ``recovery_s`` and every figure)
and ``docs/benchmarks/gpu.md``; ``--out`` puts both elsewhere.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from engine.metrics import CONFIG_FILE, read_metrics

ROOT = Path(__file__).resolve().parents[1]
FAULT_CASES = "killed_node_leaves or ring_of_four"
GPU_TESTS = "gpu_defaults or trains_with_apex or slow_on_its_device or decodes_jpegs_on_the_gpu"  # (-k, test_gpu.py)
STEP_TIMEOUT_S = 240  # each of the two training runs

PLAIN = r"""
import json, statistics, sys, time
import timm, torch
a = json.loads(sys.argv[1])
device = torch.device(a["device"])
torch.backends.cudnn.benchmark = a["cudnn_benchmark"]
fmt = torch.channels_last if a["channels_last"] else torch.contiguous_format
model = timm.create_model(a["model"], num_classes=a["classes"]).to(device).to(memory_format=fmt)
if a["compile"]:
    model.compile(backend=a["compile_backend"])
dtype = getattr(torch, a["dtype"]) if a["dtype"] else None
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
x = torch.randn(a["batch"], 3, a["size"], a["size"], device=device).contiguous(memory_format=fmt)
y = torch.randint(a["classes"], (a["batch"],), device=device)
times = []
for _ in range(a["steps"]):
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    loss.item()  # one drain a step, as the trainer's
    times.append(time.perf_counter() - start)
print(json.dumps({"step_s": statistics.median(times[a["skip"]:])}))
"""


def environment(device: str) -> dict[str, Any]:
    import timm
    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "timm": timm.__version__, "cpus": len(os.sched_getaffinity(0))}
    if device == "cuda":
        env["device"] = torch.cuda.get_device_name()
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        env["bf16"] = torch.cuda.is_bf16_supported()
    else:
        env["device"], env["nccl"], env["bf16"] = "cpu", None, True
    return env


def plain_loop(settings: dict[str, Any]) -> float:
    """Seconds per step (median) of the plain loop, in a process of its own."""
    cmd = [sys.executable, "-c", PLAIN, json.dumps(settings)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False, timeout=STEP_TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(f"the plain loop failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["step_s"]


def ours(overrides: list[str], run_dir: Path, skip: int) -> dict[str, float]:
    """``train.py`` as a user runs it; medians of its own records from step ``skip`` on."""
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides, f"trainer.run_dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env = dict(env, WANDB_SILENT="true")
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=STEP_TIMEOUT_S)
    (run_dir / "train.out").write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"train.py failed ({' '.join(overrides)}):\n{(out.stdout + out.stderr)[-3000:]}")
    records = read_metrics(str(run_dir / "metrics.jsonl"))
    steps = [r for r in records if r["kind"] == "train" and r["step"] >= skip]
    figures = {k: statistics.median(r[k] for r in steps) for k in ("step_s", "data_s", "compute_s", "comm_s")}
    figures["img_s"] = statistics.median(r["samples_per_s"] for r in steps)
    figures["steps"] = len(steps)
    return figures


def loader_rate(root: Path, device: str, batch: int, image_size: int, epochs: int = 2) -> dict[str, float]:
    """Images/s of the imagefolder training loader alone (workers decode and augment; the device normalizes), over
    whole epochs after a first one that starts the (persistent) workers: from each epoch's first request to its
    last batch on the device, so every image of it is decoded inside the timed window. (Timing the batches after
    the first of an epoch would time the queue draining: the workers decode up to ``prefetch_factor`` batches each
    ahead, which for a short epoch is all of it.)"""
    import torch

    from data.common import Loaders
    from data.imagefolder import build

    data = build(str(root), image_size=image_size, decode="cpu")
    loaders = Loaders(data, batch, "auto", 0, torch.device(device), channels_last=device == "cuda")
    loaders.build(1, 0)
    seconds, n = 0.0, 0
    for epoch in range(1 + epochs):
        loaders.start_epoch(epoch)
        start, count = time.perf_counter(), 0
        for x, _ in loaders.train:
            count += len(x)
        if device == "cuda":
            torch.cuda.synchronize()
        if epoch:  # (epoch 0 starts the workers)
            seconds, n = seconds + time.perf_counter() - start, n + count
    return {"img_s": n / seconds, "num_workers": loaders.num_workers, "images": n, "batch": batch}


def real_images(a: Any, result: dict[str, Any], work: Path, overrides: list[str], device: str, size: int,
                save: Any) -> None:  # fmt: skip
    """``train.py`` on an ImageNet-like tree for each of ``a.real_decodes``, the device decode path alone and its
    agreement with the CPU decode, the workers' loader alone: into ``result``."""
    from bench import decode as bench_decode
    from bench.jpegs import write_tree

    folder = work / "jpegs"
    write_tree(folder, a.images)
    base = [o for o in overrides if not o.startswith("data")]
    decodes = [d for d in a.real_decodes.split(",") if d] if device == "cuda" else ["cpu"]  # (no GPU: the CPU's)
    for decode in decodes:
        run = [*base, "data=imagefolder", f"data.root={folder}", f"data.decode={decode}", f"data.image_size={size}",
               f"data.batch_size={a.batch}", "data.num_workers=auto", "trainer.epochs=1000",
               "trainer.eval_every=1000"]  # fmt: skip
        try:
            figures = ours(run, work / f"real-{decode}", a.skip)
            result["real"][decode] = figures
            result["real_img_s" if decode == "gpu" else "real_cpu_img_s"] = figures["img_s"]
            print(f"  train.py on real JPEGs, data.decode={decode}: {figures['img_s']:.0f} img/s "
                  f"({figures['img_s'] / result['synthetic_img_s']:.3f} of synthetic); data wait "
                  f"{figures['data_s'] * 1e3:.2f} ms a step", flush=True)  # fmt: skip
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            result["errors"][f"real_{decode}"] = str(error)[-2000:]
            print(f"  train.py on real JPEGs ({decode}) failed: {str(error)[-1500:]}", flush=True)
        save()
    if result["real_img_s"] is not None:  # (null where not measured: no GPU to decode on)
        result["real_ratio"] = result["real_img_s"] / result["synthetic_img_s"]
    batch = 8 if a.smoke else 256
    result.update(bench_decode.device_decode_rate(folder, device, batch, 8, size, 3))
    print(f"  decode + crop alone ({device}): {result['decode_img_s']:.0f} img/s", flush=True)
    if a.agree_batches:
        result.update(bench_decode.agreement(folder, device, 4 if a.smoke else 32, a.agree_batches, size))
        print(
            f"  against the CPU decode over {result['agree_batches']} batches: {result['agree_failed_batches']} "
            f"outside the bound, worst image mean {result['agree_worst_mean_levels']:.2f} levels",
            flush=True,
        )
    save()
    rate = loader_rate(folder, device, min(a.batch, 64), size, epochs=1 if a.smoke else 2)
    result.update(loader_img_s=rate["img_s"], loader_workers=rate["num_workers"], loader_batch=rate["batch"])
    print(f"  imagefolder loader, CPU decode: {rate['img_s']:.0f} img/s ({rate['num_workers']} workers, batch "
          f"{rate['batch']}, whole epochs with the workers started)", flush=True)  # fmt: skip
    save()


def fault_recoveries(smoke: bool, basetemp: Path, timeout_s: float, gpu_tests: str, log: Path) -> dict[str, Any]:
    """``make test-gpu``'s kill cases on NCCL, run beside the GPU tests named by ``gpu_tests`` (a ``-k`` expression
    over tests/test_gpu.py); each test's outcome and each ``rank_lost`` event's recovery. Under smoke, collected
    only."""
    selection = f"({FAULT_CASES}) or ({gpu_tests})" if gpu_tests else FAULT_CASES
    files = ["tests/test_faults.py", *(["tests/test_gpu.py"] if gpu_tests else [])]
    cmd = [sys.executable, "-m", "pytest", "-rA", "--tb=short", "-m", "", "-p", "no:cacheprovider",
           f"--basetemp={basetemp}", *files, "-k", selection]  # fmt: skip
    if smoke:
        cmd += ["-q", "--collect-only"]
    else:  # (-v: a line per test as it ends, written as it comes, so a run cut short still tells which ended how)
        cmd += ["-v", *(["-n", "8"] if _has_xdist() else [])]
    env = dict(os.environ, RELAXSYNC_TEST_GPU="0" if smoke else "1")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # (pytest and its workers; the nodes have sessions of their own)
            code = proc.wait()
            out.write(f"\ntimed out after {timeout_s:.0f} s\n")
    text = log.read_text()
    cases = [line.strip() for line in text.splitlines() if line.strip().startswith("tests/") and "::" in line]
    outcomes = {} if smoke else outcomes_of(text)
    events = []
    for path in sorted(basetemp.rglob("metrics.jsonl")):
        for record in read_metrics(str(path)):  # (a run killed at the deadline may end in half a line)
            if record.get("event") == "rank_lost":
                config = path.parent / CONFIG_FILE
                sync = yaml.safe_load(config.read_text())["sync"]["_target_"] if config.exists() else ""
                events.append({"run": path.parent.parent.name, "sync": sync, "ranks": record["ranks"],
                               "redo": record.get("redo"), "recovery_s": record["recovery_s"]})  # fmt: skip
    summary = text.strip().splitlines()[-1:] or [""]
    cases = cases if smoke else sorted(outcomes)
    return {"exit": code, "summary": summary, "cases": cases, "tests": outcomes, "rank_lost": events}


def outcomes_of(text: str) -> dict[str, str]:
    """Each test's outcome from pytest's ``-v`` lines (``tests/f.py::t PASSED [ 50%]``, or with xdist
    ``[gw1] [ 50%] PASSED tests/f.py::t``); the ``-rA`` summary's lines agree with them."""
    outcomes = {}
    for line in text.splitlines():
        test = re.search(r"tests/\S+::\S+", line)
        word = re.search(r"\b(PASSED|FAILED|SKIPPED|ERROR)\b", line)
        if test and word:
            outcomes[test.group(0)] = word.group(1)
    return outcomes


def _has_xdist() -> bool:
    try:
        import xdist  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny, on the CPU: that every step still runs")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=60, help="steps of each run; medians from --skip on")
    p.add_argument("--skip", type=int, default=10)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--compile", action="store_true", help="model.compile=true on both sides")
    p.add_argument(
        "--images", type=int, help="training files of the real images (default 2048, 48 under --smoke; 0: no such part)"
    )
    p.add_argument("--real-decodes", default="gpu,cpu", help="data.decode values train.py runs on the real images")
    p.add_argument("--agree-batches", type=int, default=200, help="batches of the GPU/CPU decode agreement")
    p.add_argument("--faults", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--faults-timeout", type=float, default=300.0)
    p.add_argument(
        "--gpu-tests",
        default=GPU_TESTS,
        help="a -k expression of tests/test_gpu.py run beside the kill cases ('' for none)",
    )
    p.add_argument("--out", type=Path, help="where the JSON and the markdown go (default: the repository's)")
    a = p.parse_args(argv)
    import torch

    device = "cpu" if a.smoke or not torch.cuda.is_available() else "cuda"
    if a.smoke:
        a.batch, a.steps, a.skip, a.model, a.agree_batches = 8, 6, 2, "test_resnet", 2
    if a.images is None:
        a.images = 48 if a.smoke else 2048
    size, classes = (32, 10) if a.smoke else (224, 1000)
    env = environment(device)
    dtype = None if device == "cpu" else ("bfloat16" if env["bf16"] else "float16")
    backend = "eager" if a.smoke else "inductor"
    print(f"bench.gpu: {env['device']}, torch {env['torch']}, NCCL {env['nccl']}, {env['cpus']} CPUs", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    result: dict[str, Any] = {
        **env, "date": datetime.date.today().isoformat(), "batch": a.batch, "model": a.model,
        "precision": dtype or "float32", "channels_last": device == "cuda", "cudnn_benchmark": True,
        "compile": a.compile, "steps": a.steps, "skip": a.skip,
    }  # fmt: skip

    plain = {"device": device, "model": a.model, "classes": classes, "batch": a.batch, "size": size, "dtype": dtype,
             "channels_last": device == "cuda", "cudnn_benchmark": True, "compile": a.compile,
             "compile_backend": backend, "steps": a.steps, "skip": a.skip}  # fmt: skip
    out = a.out or ROOT
    json_path = (out / "bench" / "results" if a.out is None else out) / f"gpu-{result['date']}.json"
    md_path = (out / "docs" / "benchmarks" if a.out is None else out) / "gpu.md"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    nan = float("nan")
    result.update(plain_img_s=nan, ours_img_s=nan, ratio=nan, loader_img_s=None, loader_workers=0, recovery_s=[])
    result.update(synthetic_img_s=nan, real_img_s=None, real_cpu_img_s=None, real_ratio=None, decode_img_s=None)
    result["real"] = {}
    result.update(ours_step_s=nan, ours_data_s=nan, ours_compute_s=nan, ours_comm_s=nan, faults={}, errors={})

    def save() -> None:  # (after each part: a run cut short keeps what it measured)
        json_path.write_text(json.dumps(result, indent=1) + "\n")
        md_path.write_text(markdown(result, " ".join(["python -m bench.gpu", *(argv or sys.argv[1:])])))

    try:
        result["plain_img_s"] = a.batch / plain_loop(plain)
        print(f"  plain torch loop: {result['plain_img_s']:.0f} img/s", flush=True)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        result["errors"]["plain"] = str(error)[-2000:]
        print(f"  plain torch loop failed: {str(error)[-500:]}", flush=True)
    save()
    overrides = [
        "sync=allreduce", "trainer.nproc=1", f"trainer.device={device}", f"model={a.model}", "data=synthetic",
        "data.dtype=uint8", f"data.image_size={size}", f"data.num_classes={classes}", f"data.batch_size={a.batch}",
        f"data.num_samples={a.batch * (a.steps + 1)}", f"data.num_val_samples={a.batch}", "data.num_workers=auto",
        "logger=none", "trainer.progress=false", "trainer.epochs=1", f"trainer.max_steps={a.steps}",
        "trainer.checkpoint_every=0", f"model.compile={str(a.compile).lower()}", f"model.compile_backend={backend}",
    ]  # fmt: skip
    try:
        figures = ours(overrides, work / "ours", a.skip)
        result.update(
            {"ours_img_s": figures["img_s"], "synthetic_img_s": figures["img_s"], "ours_steps": figures["steps"]}
        )
        result.update({f"ours_{k}": figures[k] for k in ("step_s", "data_s", "compute_s", "comm_s")})
        result["ratio"] = result["ours_img_s"] / result["plain_img_s"]
        print(f"  train.py: {figures['img_s']:.0f} img/s (ratio {result['ratio']:.3f}); per step: data wait "
              f"{figures['data_s'] * 1e3:.2f} ms, GPU compute {figures['compute_s'] * 1e3:.2f} ms, GPU comm "
              f"{figures['comm_s'] * 1e3:.2f} ms", flush=True)  # fmt: skip
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        result["errors"]["ours"] = str(error)[-2000:]
        print(f"  train.py failed: {str(error)[-1500:]}", flush=True)
    save()

    if a.images:  # (0: left out)
        real_images(a, result, work, overrides, device, size, save)

    faults = {}
    if a.faults:
        log = (out if a.out else work) / "faults.log"
        faults = fault_recoveries(a.smoke or device == "cpu", work / "faults", a.faults_timeout, a.gpu_tests, log)
    result["faults"] = faults
    result["recovery_s"] = [e["recovery_s"] for e in faults.get("rank_lost", [])]
    for e in faults.get("rank_lost", []):
        print(f"  {e['sync']} ({e['run']}): lost {e['ranks']}, redo {e['redo']}, recovery {e['recovery_s']:.2f} s")
    for test, outcome in faults.get("tests", {}).items():
        print(f"  {outcome} {test}")
    if faults:
        print(f"  tests: {faults['summary'][0]} ({len(faults['cases'])} collected)", flush=True)

    save()
    print(f"bench.gpu: wrote {json_path} and {md_path}", flush=True)
    return result


def markdown(r: dict[str, Any], command: str) -> str:
    recoveries = ", ".join(f"{s:.2f}" for s in r["recovery_s"]) or "none measured"
    faults = r["faults"]["summary"][0] if r["faults"] else "not run"
    rows = [
        ("plain torch loop (same model, batch, precision, layout, cudnn.benchmark, compile)", f"{r['plain_img_s']:.0f}"),  # noqa: E501
        ("`train.py` (sync=allreduce, one process, uint8 synthetic images via the loaders)", f"{r['ours_img_s']:.0f}"),
        ("ratio (ours / plain)", f"{r['ratio']:.3f}"),
    ]  # fmt: skip
    if r["real"]:  # (--images 0: not measured)
        for decode, figures in r["real"].items():
            share = figures["img_s"] / r["synthetic_img_s"]
            rows.append((f"`train.py` on real JPEGs (`data=imagefolder data.decode={decode}`; "
                         f"{share:.3f} of the synthetic run; data wait {figures['data_s'] * 1e3:.2f} ms a step)",
                         f"{figures['img_s']:.0f}"))  # fmt: skip
    if "decode_batch" in r:  # (after the real runs: a run cut short saves before)
        rows.append(("decode + crop alone on the device (nvJPEG, crops, resizes, flips, normalization; batch "
                     f"{r['decode_batch']})", f"{r['decode_img_s']:.0f}"))  # fmt: skip
    if r["loader_workers"]:
        rows.append((f"imagefolder loader alone, CPU decode ({r['loader_workers']} workers, whole epochs)",
                     f"{r['loader_img_s']:.0f}"))  # fmt: skip
    lines = [
        "# One GPU: train.py against a plain torch loop, the loader, NCCL recoveries",
        "",
        f"`{command}` (`make bench-gpu`), {r['date']}: {r['device']}, torch {r['torch']}, NCCL {r['nccl']}, "
        f"{r['cpus']} CPUs; {r['model']}, batch {r['batch']}, {r['precision']}, channels_last {r['channels_last']}, "
        f"cudnn.benchmark, compile {r['compile']}; medians of steps {r['skip']}-{r['steps'] - 1}. "
        "Both loops run in one invocation on the same GPU. Raw figures: `bench/results/gpu-<date>.json`.",
        "",
        "| what | images/s |",
        "| --- | --- |",
        *(f"| {a} | {b} |" for a, b in rows),
        "",
        f"Per step of `train.py`: data wait {r['ours_data_s'] * 1e3:.2f} ms, GPU compute "
        f"{r['ours_compute_s'] * 1e3:.2f} ms, GPU communication {r['ours_comm_s'] * 1e3:.2f} ms, "
        f"step {r['ours_step_s'] * 1e3:.2f} ms.",
        "",
        *([f"GPU decode against the CPU decode of the same files, {r['agree_batches']} batches of "
           f"{r['agree_batch']} with writes queued on the stream: {r['agree_failed_batches']} batches with an image "
           f"at a mean difference of {r['agree_bound_levels']:.0f} levels or more; worst image mean "
           f"{r['agree_worst_mean_levels']:.2f}, largest difference {r['agree_max_levels']:.0f}.", ""]
          if "agree_batches" in r else []),
        f"NCCL kill cases (`make test-gpu`'s): {faults}; "
        f"`recovery_s` of each `rank_lost`: {recoveries}.",
        "",
    ]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
