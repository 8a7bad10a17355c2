"""What a Hugging Face Hub revision resolves to: the commit a branch or tag pointed at when a run
fetched from it, recorded in the run's provenance (a branch such as `main` moves; the commit does not)."""

from __future__ import annotations

from megatron_core.errors import UserError


def hub_commit(repo_id: str, revision: str, repo_type: str) -> str:
    """The commit sha `revision` of the Hub repository `repo_id` ("dataset" or "model") points at now."""
    try:
        from huggingface_hub import HfApi

        info = (HfApi().dataset_info if repo_type == "dataset" else HfApi().model_info)(repo_id, revision=revision)
    except Exception as exc:  # noqa: BLE001 - any Hub failure means the same thing to the user
        raise UserError(
            f"cannot resolve {repo_type} {repo_id}@{revision} on the Hugging Face Hub "
            f"({type(exc).__name__}); without internet use local files "
            "(see the recipe's sources)"
        ) from None
    return info.sha
