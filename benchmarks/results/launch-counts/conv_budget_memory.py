"""Peak tensor memory of the Tanh CNN's DP-SGD step against PyTorch's, on the CPU with an accelerator's settings
(dpopt.launches.accelerator_settings: its chunk budget, so the conv patches are cut as on a GPU), and the step's
launching operations. Run: python benchmarks/results/launch-counts/conv_budget_memory.py"""

from dpopt import bench, launches


def peak(system: str, case: bench.Case) -> float:
    model, data, loss = bench._workload(case, system)
    step = bench._step_fn(system, case, model, data, loss)
    step(), step()
    return bench.peak_tensor_mb(step)


for batch in (64, 256, 1024):
    case = bench.Case("cnn", batch)
    with launches.accelerator_settings():
        model, data, loss = bench._workload(case, "dpopt")
        count = launches.count_step(bench._step_fn("dpopt", case, model, data, loss))
        dp, pt = peak("dpopt", case), peak("pytorch", case)
    print(f"cnn b{batch}: launching ops {count.launching_ops}, peak MB dpopt {dp:.1f} pytorch {pt:.1f}, "
          f"ratio {dp / pt:.3f}", flush=True)
