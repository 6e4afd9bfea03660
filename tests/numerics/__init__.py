"""JAX numerics: the trainer's training runs, and programs compiled, cached and restored in processes of their own.
Run: python -m pytest tests/numerics"""
