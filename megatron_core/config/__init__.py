"""Recipes: typed, validated, hashed. A recipe is a YAML file with a `name`, a `version`, optionally a
`base` recipe it changes, and one mapping per schema section. Everything a run does is decided by the
resolved recipe, and its hash is written into every output.

One module per job, each importing only those below it:

- `loading`: `load_recipe` (find, read with bases, apply `--set`, type, validate)
- `discovery`: the recipes directory, names and families, `base:` inheritance, the GPU count (lazily)
- `overrides`: `--set key=value`
- `parsing`: a raw mapping typed into a `Recipe`, with messages for people
- `validation`: impossible combinations refused before any work starts (batch, schedule, precision)
- `model_spec`: `ModelSpec`, the model's shape and parallel layout with every rule they must satisfy
- `schema`: the sections, their defaults (Megatron-LM's), the typed corpus sources, `Recipe` and its
  resolved dictionary
- `hashing`: the recipe hash and each pipeline stage's hash; `resume`: keys a resume may change

Import from here (`from megatron_core.config import load_recipe`): these names are the interface.
"""

from megatron_core.config.discovery import (
    list_recipe_files,
    read_recipe_file,
    recipes_dir,
    resolve_recipe_path,
    visible_gpu_count,
)
from megatron_core.config.hashing import canonical_hash
from megatron_core.config.loading import load_recipe
from megatron_core.config.model_spec import ModelSpec
from megatron_core.config.overrides import apply_overrides
from megatron_core.config.parsing import recipe_from_dict
from megatron_core.config.resume import RESUME_SAFE_KEYS
from megatron_core.config.schema import (
    SECTIONS,
    SOURCE_TYPES,
    TOP_LEVEL,
    CorpusConfig,
    CorpusSource,
    DataConfig,
    EvaluateConfig,
    HfDatasetSource,
    JsonlSource,
    ModelConfig,
    ParallelConfig,
    PythonStdlibSource,
    Recipe,
    TokenizerConfig,
    TrainingConfig,
)
from megatron_core.config.validation import lr_warmup_problem, validate
from megatron_core.errors import UserError

__all__ = [
    "RESUME_SAFE_KEYS",
    "SECTIONS",
    "SOURCE_TYPES",
    "TOP_LEVEL",
    "CorpusConfig",
    "CorpusSource",
    "DataConfig",
    "EvaluateConfig",
    "HfDatasetSource",
    "JsonlSource",
    "ModelConfig",
    "ModelSpec",
    "ParallelConfig",
    "PythonStdlibSource",
    "Recipe",
    "TokenizerConfig",
    "TrainingConfig",
    "UserError",
    "apply_overrides",
    "canonical_hash",
    "list_recipe_files",
    "load_recipe",
    "lr_warmup_problem",
    "read_recipe_file",
    "recipe_from_dict",
    "recipes_dir",
    "resolve_recipe_path",
    "validate",
    "visible_gpu_count",
]
