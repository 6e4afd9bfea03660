"""The cost-aware autoscaling policy: options, prices, spot knowledge, restart costs, the plan and its moves."""
