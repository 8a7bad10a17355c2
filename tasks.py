"""`invoke <task>` in the checkout: the collection is megatron_core/cli.py's (installed as `megatron-recipes`)."""

from megatron_core.cli import *  # noqa: F401,F403 - the tasks by name (tests call tasks.train)
from megatron_core.cli import ns  # noqa: F401 - invoke loads the collection named ns
