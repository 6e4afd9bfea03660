"""How the cost policy is judged: the simulator over spot traces, the hindsight optimum, the baselines."""
