"""Pure decisions, table-tested without Ray: nothing here imports the rest of the project.

- `policies.decisions`: what a job does next: recovery after an attempt ends, admission from
  the queue, the budget cap and the deadline forecast.
- `policies.cost`: the cost-aware autoscaling policy: slice options and their prices, what is
  known of spot capacity, restart costs, the plan and the moves it makes.
- `policies.evaluation`: how the policy is judged: the simulator over spot traces, the
  hindsight optimum and the baselines.
- `policies.model`: the model arithmetic the controller and the workers both read: the
  model's shape and FLOPs, its sharding over the mesh, and its memory fit.
"""
