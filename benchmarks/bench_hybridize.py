"""hybridize() against eager PyTorch, torch.compile and TorchScript, side by side in one run.

1. d2l 12.1's MLP (512-256-128-2) at batch 1: microseconds per inference call, 1000 calls per
   sample after warm-up, every contender under ``torch.no_grad()`` (the hybrid's inference
   backends serve only calls that do not record autograd; eager with autograd is shown too).
2. Captured training steps (``dlperf.hybrid.train_step``, backend ``auto``) of the MLP at batch 1 and 64
   against the eager step (zero grads, forward, loss, backward, SGD with momentum) and the forward-only
   hybrid step, one intra-op thread, alternating; the captured step is also set against the cost
   model's floor for it (compute + memory of the step, as :mod:`dlperf.probe.cost` counts them, on this
   machine's estimated figures; a captured step pays one dispatch, not one per operator).
3. Training steps of LeNet at batch 256 and ResNet-56 at batch 128: eager against
   ``dlperf.hybrid.bench_mode.make_step`` (forward replayed, autograd on) and the captured step (``auto``).
4. With a CUDA GPU: the MLP at batch 1 eager against CUDA-graph replay, inference and training.

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

from dlperf.hybrid import hybridize
from dlperf.hybrid.backends import native
from dlperf.hybrid.bench_mode import make_step
from dlperf.hybrid.train_step import train_step
from dlperf.models import get_spec
from dlperf.steps import eager_step
from dlperf.timing import Timing, time_steps

CALLS = 1000  # per timing sample, as in the book's benchmark


def time_round_robin(contenders: dict[str, tuple], x, samples: int, sync=lambda: None) -> dict[str, Timing]:
    """Per-call seconds of each contender, sampled in turns so that load from other processes on a
    shared machine hits every contender alike. A sample is the mean of CALLS back-to-back calls
    (the timer's own cost amortized); ``contenders`` maps name -> (callable, grad_enabled)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for i in range(samples + 1):  # round 0 is warm-up
        for name, (fn, grad) in contenders.items():
            with torch.set_grad_enabled(grad):
                sync()
                t0 = time.perf_counter()
                for _ in range(CALLS):
                    fn(x)
                sync()
                if i > 0:
                    times[name].append((time.perf_counter() - t0) / CALLS)
    return {name: Timing.from_samples(v) for name, v in times.items()}


def mlp_section(samples: int, with_compile: bool) -> tuple[list[tuple], dict]:
    torch.manual_seed(0)
    model = get_spec("mlp").build().eval()
    x = torch.randn(1, 512)
    notes: dict[str, str] = {}
    with torch.no_grad():
        ref = model(x)
        graph = hybridize(copy.deepcopy(model), backend="graph")
        graph(x)
        net = hybridize(copy.deepcopy(model))  # auto: times candidates on the first call
        t0 = time.perf_counter()
        torch.testing.assert_close(net(x), ref, rtol=1e-5, atol=1e-6)
        first_call_s = time.perf_counter() - t0
        (choice,) = net.choices.values()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript is deprecated; measured as a peer
            t0 = time.perf_counter()
            scripted = torch.jit.freeze(torch.jit.trace(copy.deepcopy(model), x))
            for _ in range(3):
                scripted(x)  # the profiling executor optimizes after a few calls
            notes["torchscript"] = f"build {time.perf_counter() - t0:.1f} s"
        compile_s = None
        if with_compile:
            compiled = torch.compile(copy.deepcopy(model))
            t0 = time.perf_counter()
            torch.testing.assert_close(compiled(x), ref, rtol=1e-5, atol=1e-6)
            compile_s = time.perf_counter() - t0
            notes["compile"] = f"compile {compile_s:.1f} s"
    contenders = {"eager_autograd": (model, True), "eager": (model, False), "graph": (graph, False),
                  "hybrid": (net, False), "torchscript": (scripted, False)}
    if with_compile:
        contenders["compile"] = (compiled, False)
    t = time_round_robin(contenders, x, samples)
    labels = {"eager_autograd": "eager (autograd on)", "eager": "eager", "graph": "hybridize graph",
              "hybrid": f"hybridize auto -> {choice.backend}", "torchscript": "TorchScript trace+freeze",
              "compile": "torch.compile"}
    notes["hybrid"] = f"first call {first_call_s:.2f} s"
    rows = [(labels[k], v, notes.get(k, "")) for k, v in t.items()]
    hybrid, eager, eager_grad = t["hybrid"], t["eager"], t["eager_autograd"]
    out = dict(hybrid_us=hybrid.median_s * 1e6, eager_us=eager.median_s * 1e6,
               eager_autograd_us=eager_grad.median_s * 1e6,
               speedup_vs_eager=eager.median_s / hybrid.median_s,
               speedup_vs_eager_autograd=eager_grad.median_s / hybrid.median_s,
               compile_us=t["compile"].median_s * 1e6 if with_compile else None,
               compile_time_s=compile_s, torchscript_us=t["torchscript"].median_s * 1e6,
               graph_us=t["graph"].median_s * 1e6,
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
    captured_model = copy.deepcopy(eager_model)
    opt_c = torch.optim.SGD(captured_model.parameters(), lr=0.01, momentum=0.9)
    cstep = train_step(captured_model, spec.loss, opt_c)
    t0 = time.perf_counter()
    cstep(x, y)  # capture, and auto's own timing of the training candidates
    capture_s = time.perf_counter() - t0
    samples: dict[str, list[float]] = {"eager": [], "hybrid": [], "captured": []}
    for i in range(3 + steps):  # 3 warm-up rounds, the hybrid's first one prepares its runner
        for mode, fn in (("eager", eager_step), ("hybrid", lambda: hstep(x, y)), ("captured", lambda: cstep(x, y))):
            t0 = time.perf_counter()
            fn()
            if i >= 3:
                samples[mode].append(time.perf_counter() - t0)
    e, h, c = (Timing.from_samples(samples[k]) for k in ("eager", "hybrid", "captured"))
    backend = next(iter(hstep.hybrid_module.choices.values())).backend
    captured_backend = next(iter(cstep.choices.values()), "eager")
    rows = [(f"{name} b{batch} train eager", e, "ms"), (f"{name} b{batch} train hybrid ({backend})", h, "ms"),
            (f"{name} b{batch} train_step auto -> {captured_backend}", c, "ms")]
    key = name.replace("-", "")
    return rows, {f"{key}_eager_ms": e.median_s * 1e3, f"{key}_hybrid_ms": h.median_s * 1e3,
                  f"{key}_speedup": e.median_s / h.median_s, f"{key}_backend": backend,
                  f"{key}_train_step_ms": c.median_s * 1e3, f"{key}_train_step_speedup": e.median_s / c.median_s,
                  f"{key}_train_step_backend": captured_backend, f"{key}_train_step_first_call_s": capture_s,
                  f"{key}_train_step_capture_s": cstep.capture_s,
                  f"{key}_train_step_reason": repr(cstep).splitlines()[-1].strip()}


def _mlp_floor_s(model, x) -> tuple[float, dict]:
    """The cost model's floor for a captured step: compute + memory, plus the one dispatch of its replay."""
    from dlperf.probe.cost import count_step, step_floor
    from dlperf.probe.profile import estimate_hardware

    hw = estimate_hardware()
    floor = step_floor(count_step(model, x), hw)
    return floor.components["compute"] + floor.components["memory"] + hw.dispatch_s, floor.to_dict()


def mlp_train_section(batch: int, samples: int) -> tuple[list[tuple], dict]:
    """The d2l MLP's training step at ``batch``: eager, forward-only hybrid, captured; one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the setting: a small step is dispatch-bound, not compute-bound
    try:
        torch.manual_seed(0)
        spec = get_spec("mlp")
        g = torch.Generator().manual_seed(2)
        x, y = spec.input.make_batch(batch, generator=g)
        base = spec.build()
        models = {k: copy.deepcopy(base) for k in ("eager", "hybrid", "captured")}
        opts = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for k, m in models.items()}
        steps = {"eager": eager_step(models["eager"], spec.loss, opts["eager"]),
                 "hybrid": make_step(models["hybrid"], spec.loss, opts["hybrid"], x, y),
                 "captured": train_step(models["captured"], spec.loss, opts["captured"])}
        t0 = time.perf_counter()
        steps["captured"](x, y)
        capture_s = time.perf_counter() - t0
        calls = 200 if batch == 1 else 40
        times: dict[str, list[float]] = {k: [] for k in steps}
        for i in range(samples + 1):  # round 0 is warm-up
            for name, fn in steps.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn(x, y)
                if i > 0:
                    times[name].append((time.perf_counter() - t0) / calls)
        t = {k: Timing.from_samples(v) for k, v in times.items()}
        # The contention check of the one timer, on the captured step alone (the ratio is alternated above).
        check = time_steps(lambda: steps["captured"](x, y), warmup=5, steps=300)
        floor_s, floor = _mlp_floor_s(base, x)
    finally:
        torch.set_num_threads(threads)
    backend = next(iter(steps["captured"].choices.values()), "eager")
    rows = [(f"mlp b{batch} train eager", t["eager"], ""),
            (f"mlp b{batch} train hybrid fwd (autograd)", t["hybrid"], ""),
            (f"mlp b{batch} train_step auto -> {backend}", t["captured"],
             f"capture {steps['captured'].capture_s:.2f} s, first call {capture_s:.2f} s"),
            (f"mlp b{batch} floor (compute+memory)", Timing.from_samples([floor_s]), "cost model")]
    e, c = t["eager"].median_s, t["captured"].median_s
    out = {f"train_step_speedup_b{batch}": e / c, f"train_step_b{batch}_us": c * 1e6,
           f"train_eager_b{batch}_us": e * 1e6, f"train_hybrid_fwd_b{batch}_us": t["hybrid"].median_s * 1e6,
           f"train_step_backend_b{batch}": backend, f"train_step_first_call_s_b{batch}": capture_s,
           f"train_step_capture_s_b{batch}": steps["captured"].capture_s,
           f"train_step_contended_b{batch}": check.contended}
    if batch == 1:
        out.update(train_step_vs_floor_b1=c / floor_s, train_step_floor_b1_us=floor_s * 1e6, train_floor_b1=floor)
    return rows, out


def gpu_train_section(samples: int) -> tuple[list[tuple], dict]:
    """The MLP's training step at batch 1 on the GPU: eager against the step replayed as one CUDA graph."""
    torch.manual_seed(0)
    spec = get_spec("mlp")
    x, y = (t.cuda() for t in spec.input.make_batch(1))
    base = spec.build().cuda()
    m_e, m_c = copy.deepcopy(base), copy.deepcopy(base)
    e = eager_step(m_e, spec.loss, torch.optim.SGD(m_e.parameters(), lr=0.01, momentum=0.9))
    c = train_step(m_c, spec.loss, torch.optim.SGD(m_c.parameters(), lr=0.01, momentum=0.9), backend="cuda_graphs")
    t = time_round_robin({"eager": (lambda xy: e(*xy), True), "graphs": (lambda xy: c(*xy), False)}, (x, y),
                         samples, torch.cuda.synchronize)
    return ([("GPU mlp train eager", t["eager"], ""), ("GPU mlp train_step cuda_graphs", t["graphs"], "")],
            {"gpu_train_step_speedup": t["eager"].median_s / t["graphs"].median_s})


def gpu_section(samples: int) -> tuple[list[tuple], dict]:
    torch.manual_seed(0)
    model = get_spec("mlp").build().eval().cuda()
    x = torch.randn(1, 512, device="cuda")
    sync = torch.cuda.synchronize
    with torch.no_grad():
        graphs = hybridize(copy.deepcopy(model), backend="cuda_graphs")
        graphs(x)
        auto = hybridize(copy.deepcopy(model))
        auto(x)
        (choice,) = auto.choices.values()
    t = time_round_robin({"eager": (model, False), "graphs": (graphs, False), "auto": (auto, False)},
                         x, samples, sync)
    eager, graphs_t, auto_t = t["eager"], t["graphs"], t["auto"]
    rows = [("GPU mlp eager", eager, ""), ("GPU mlp cuda_graphs", graphs_t, ""),
            (f"GPU mlp auto -> {choice.backend}", auto_t, "")]
    return rows, {"gpu_eager_us": eager.median_s * 1e6, "gpu_cuda_graphs_us": graphs_t.median_s * 1e6,
                  "gpu_speedup_vs_eager": eager.median_s / graphs_t.median_s, "gpu_auto_backend": choice.backend}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=15, help="timing samples per MLP contender")
    parser.add_argument("--train-steps", type=int, default=10, help="timed training steps per mode")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (slow to compile)")

    parser.add_argument("--train-samples", type=int, default=9, help="alternating samples per MLP training row")
    args = parser.parse_args(argv)
    try:
        native.load_extension()  # built or loaded now: capture_s is the capture, not the one-time compile
    except RuntimeError as exc:
        print(f"native plan interpreter unavailable: {exc}")

    rows, result = mlp_section(args.samples, not args.no_compile)
    for batch in (1, 64):
        r, o = mlp_train_section(batch, args.train_samples)
        rows += r
        result.update(o)
    for name, batch in (("lenet", 256), ("resnet-56", 128)):
        r, o = training_section(name, batch, args.train_steps)
        rows += r
        result.update(o)
    if torch.cuda.is_available():
        for section in (gpu_section, gpu_train_section):
            r, o = section(args.samples)
            rows += r
            result.update(o)
    result["threads"] = torch.get_num_threads()
    # capture_s: tracing and preparing (native backend cached); first_call_s adds auto's timing of the candidates.
    result["capture_s"] = {"mlp": result["train_step_capture_s_b1"], "lenet": result["lenet_train_step_capture_s"]}
    result["first_call_s"] = {"mlp": result["train_step_first_call_s_b1"],
                              "lenet": result["lenet_train_step_first_call_s"]}
    result["contended"] = bool(result.get("train_step_contended_b1") or result.get("train_step_contended_b64"))

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
    print(f"MLP training step: captured {result['train_step_speedup_b1']:.1f}x eager at batch 1, "
          f"{result['train_step_speedup_b64']:.1f}x at batch 64, {result['train_step_vs_floor_b1']:.1f}x the floor; "
          f"LeNet {result['lenet_train_step_speedup']:.2f}x, ResNet-56 {result['resnet56_train_step_speedup']:.2f}x"
          f"{' (contended: other processes competed for the cores)' if result['contended'] else ''}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
