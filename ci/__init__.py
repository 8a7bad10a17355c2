"""CI helpers: golden loss values (ci/golden.py) and the scripts the GitHub workflow calls."""
