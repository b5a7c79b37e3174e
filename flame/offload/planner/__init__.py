"""The offload planner: pure arithmetic over measured numbers, no torch.

- `hardware`: the hardware profile (measured rates) and its JSON file;
- `block_costs`: per-block costs of a model at one micro-batch;
- `cost_model`: predicted step time and memory of a plan;
- `solver`: the fastest plan under the budgets (`budgets`: their defaults);
- `plan`: the plan the runtime executes, and its JSON file;
- `refit`: comparing a plan's prediction with a measured step and solving again.

The measurements these numbers come from are in `flame.offload.measure`; the engine that runs a
plan is in `flame.offload.runtime`.
"""
