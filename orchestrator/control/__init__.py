"""The control loop: the controller actor, its per-job drivers, admission and autoscaling."""
