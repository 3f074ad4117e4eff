"""Profile one system's step of a bench case: top ops by device time and by CPU time, and the host syncs."""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from dpopt import bench

system, workload, batch, dev = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(1)
case = bench.Case(workload, batch, threads=1, device=dev)
model, data, loss = bench._workload(case, system)
step = bench._synchronized(bench._step_fn(system, case, model, data, loss), torch.device(dev))
for _ in range(3):
    step()
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
with profile(activities=acts) as p:
    for _ in range(5):
        step()
ka = p.key_averages()
print(f"== {system} {workload} b{batch} {dev}: 5 steps")
if dev == "cuda":
    print(ka.table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
print(ka.table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60))
