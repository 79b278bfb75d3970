"""hybridize() against eager PyTorch, torch.compile and TorchScript, side by side in one run.

1. d2l 12.1's MLP (512-256-128-2) at batch 1: microseconds per inference call, 1000 calls per
   sample after warm-up, every contender under ``torch.no_grad()`` (the hybrid's inference
   backends serve only calls that do not record autograd; eager with autograd is shown too).
2. Training steps (zero grads, forward, loss, backward, SGD update) of LeNet at batch 256 and
   ResNet-56 at batch 128: eager against ``dlperf.hybrid.bench_mode.make_step``.
3. With a CUDA GPU: the MLP at batch 1 eager against CUDA-graph replay.

Prints a fixed-width table, then one JSON object as the last line.

    flock /tmp/dlperf-cpu.lock python benchmarks/bench_hybridize.py
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import warnings

import torch

from dlperf.bench.timing import Timing, time_steps
from dlperf.hybrid import hybridize
from dlperf.hybrid.bench_mode import make_step
from dlperf.models import get_spec

CALLS = 1000  # per timing sample, as in the book's benchmark


def time_calls(fn, x, samples: int, sync=lambda: None) -> Timing:
    """Per-call seconds: each sample is the mean of CALLS back-to-back calls (timer cost amortized)."""

    def block():
        for _ in range(CALLS):
            fn(x)

    t = time_steps(block, warmup=1, steps=samples, synchronize=sync)
    return Timing.from_samples([s / CALLS for s in t.samples])


def mlp_section(samples: int, with_compile: bool) -> tuple[list[tuple], dict]:
    torch.manual_seed(0)
    model = get_spec("mlp").build().eval()
    x = torch.randn(1, 512)
    rows, out = [], {}
    eager_grad = time_calls(model, x, samples)
    rows.append(("eager (autograd on)", eager_grad, ""))
    with torch.no_grad():
        ref = model(x)
        eager = time_calls(model, x, samples)
        rows.append(("eager", eager, ""))

        graph = hybridize(copy.deepcopy(model), backend="graph")
        graph(x)
        rows.append(("hybridize graph", time_calls(graph, x, samples), ""))

        net = hybridize(copy.deepcopy(model))  # auto: times candidates on the first call
        t0 = time.perf_counter()
        torch.testing.assert_close(net(x), ref, rtol=1e-5, atol=1e-6)
        first_call_s = time.perf_counter() - t0
        hybrid = time_calls(net, x, samples)
        (choice,) = net.choices.values()
        rows.append((f"hybridize auto -> {choice.backend}", hybrid, f"first call {first_call_s:.2f} s"))

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript is deprecated; measured as a peer
            t0 = time.perf_counter()
            scripted = torch.jit.freeze(torch.jit.trace(copy.deepcopy(model), x))
            for _ in range(3):
                scripted(x)  # the profiling executor optimizes after a few calls
            ts_build_s = time.perf_counter() - t0
        torchscript = time_calls(scripted, x, samples)
        rows.append(("TorchScript trace+freeze", torchscript, f"build {ts_build_s:.1f} s"))

        compiled_t, compile_s = None, None
        if with_compile:
            compiled = torch.compile(copy.deepcopy(model))
            t0 = time.perf_counter()
            compiled(x)
            compile_s = time.perf_counter() - t0
            compiled_t = time_calls(compiled, x, samples)
            rows.append(("torch.compile", compiled_t, f"compile {compile_s:.1f} s"))
    out.update(hybrid_us=hybrid.median_s * 1e6, eager_us=eager.median_s * 1e6,
               eager_autograd_us=eager_grad.median_s * 1e6,
               speedup_vs_eager=eager.median_s / hybrid.median_s,
               speedup_vs_eager_autograd=eager_grad.median_s / hybrid.median_s,
               compile_us=compiled_t.median_s * 1e6 if compiled_t else None,
               compile_time_s=compile_s, torchscript_us=torchscript.median_s * 1e6,
               hybrid_backend=choice.backend, hybrid_reason=choice.reason,
               hybrid_first_call_s=first_call_s, hybrid_noisy=hybrid.noisy)
    return rows, out


def training_section(name: str, batch: int, steps: int) -> tuple[list[tuple], dict]:
    """Eager and hybrid steps on the same batch, alternated step by step so that load from other
    processes on a shared machine hits both alike."""
    torch.manual_seed(0)
    spec = get_spec(name)
    g = torch.Generator().manual_seed(1)
    x, y = spec.input.make_batch(batch, generator=g)
    eager_model = spec.build()
    hybrid_model = copy.deepcopy(eager_model)
    opt_e = torch.optim.SGD(eager_model.parameters(), lr=0.01, momentum=0.9)
    opt_h = torch.optim.SGD(hybrid_model.parameters(), lr=0.01, momentum=0.9)

    def eager_step():
        opt_e.zero_grad(set_to_none=True)
        loss = spec.loss(eager_model(x), y)
        loss.backward()
        opt_e.step()
        return loss

    hstep = make_step(hybrid_model, spec.loss, opt_h, x, y)
    samples: dict[str, list[float]] = {"eager": [], "hybrid": []}
    for i in range(3 + steps):  # 3 warm-up rounds, the hybrid's first one prepares its runner
        for mode, fn in (("eager", eager_step), ("hybrid", lambda: hstep(x, y))):
            t0 = time.perf_counter()
            fn()
            if i >= 3:
                samples[mode].append(time.perf_counter() - t0)
    e, h = Timing.from_samples(samples["eager"]), Timing.from_samples(samples["hybrid"])
    backend = next(iter(hstep.hybrid_module.choices.values())).backend
    rows = [(f"{name} b{batch} train eager", e, "ms"), (f"{name} b{batch} train hybrid ({backend})", h, "ms")]
    key = name.replace("-", "")
    return rows, {f"{key}_eager_ms": e.median_s * 1e3, f"{key}_hybrid_ms": h.median_s * 1e3,
                  f"{key}_speedup": e.median_s / h.median_s, f"{key}_backend": backend}


def gpu_section(samples: int) -> tuple[list[tuple], dict]:
    torch.manual_seed(0)
    model = get_spec("mlp").build().eval().cuda()
    x = torch.randn(1, 512, device="cuda")
    sync = torch.cuda.synchronize
    with torch.no_grad():
        eager = time_calls(model, x, samples, sync)
        net = hybridize(copy.deepcopy(model), backend="cuda_graphs")
        net(x)
        graphs = time_calls(net, x, samples, sync)
        auto = hybridize(copy.deepcopy(model))
        auto(x)
        auto_t = time_calls(auto, x, samples, sync)
        (choice,) = auto.choices.values()
    rows = [("GPU mlp eager", eager, ""), ("GPU mlp cuda_graphs", graphs, ""),
            (f"GPU mlp auto -> {choice.backend}", auto_t, "")]
    return rows, {"gpu_eager_us": eager.median_s * 1e6, "gpu_cuda_graphs_us": graphs.median_s * 1e6,
                  "gpu_speedup_vs_eager": eager.median_s / graphs.median_s, "gpu_auto_backend": choice.backend}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=15, help="timing samples per MLP contender")
    parser.add_argument("--train-steps", type=int, default=10, help="timed training steps per mode")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (slow to compile)")
    args = parser.parse_args(argv)

    rows, result = mlp_section(args.samples, not args.no_compile)
    for name, batch in (("lenet", 256), ("resnet-56", 128)):
        r, o = training_section(name, batch, args.train_steps)
        rows += r
        result.update(o)
    if torch.cuda.is_available():
        r, o = gpu_section(args.samples)
        rows += r
        result.update(o)
    result["threads"] = torch.get_num_threads()

    print(f"{'contender':<40} {'median':>11} {'IQR/med':>8}  note")
    for name, t, note in rows:
        if note == "ms":
            value, note = f"{t.median_s * 1e3:8.2f} ms", ""
        else:
            value = f"{t.median_s * 1e6:8.2f} us"
        flag = " noisy" if t.noisy else ""
        print(f"{name:<40} {value:>11} {t.rel_spread:>7.1%}  {note}{flag}")
    print(f"MLP: hybrid {result['hybrid_us']:.2f} us vs eager {result['eager_us']:.2f} us "
          f"({result['speedup_vs_eager']:.1f}x); chosen because {result['hybrid_reason']}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
