"""The code's own checks: the layers and import cycles (import-linter), the linter (ruff), the type checker
(mypy), and what the code imports against what pyproject.toml declares. Run: python -m pytest tests/checks"""
