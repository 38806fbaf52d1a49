"""Download progress for `pull` and download-on-first-use: huggingface_hub's tqdm bars forwarded to rich."""

from __future__ import annotations

from typing import Any

from dflash_cli.settings import env_flag


def progress_enabled(stream: Any) -> bool:
    """Bars only on a terminal, and never with HF_HUB_DISABLE_PROGRESS_BARS set."""
    from dflash_cli.ui.render import isatty

    return isatty(stream) and not env_flag("HF_HUB_DISABLE_PROGRESS_BARS")


def make_tqdm_class(progress: Any, label: str) -> type:
    """A tqdm subclass for `snapshot_download(tqdm_class=)` that forwards to a rich Progress (or to nothing).

    huggingface_hub opens three bars: transfer bytes, "reconstructed" (written) bytes, and a file count.
    The written-bytes bar (exact total) and the file count are shown; the transfer bar is dropped.
    """
    import io

    from tqdm.std import tqdm as std_tqdm

    class RichTqdm(std_tqdm):
        _task = None  # tqdm's __init__ refreshes before the rich task exists

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            kwargs["file"] = io.StringIO()  # tqdm itself draws nothing anywhere
            kwargs["disable"] = False
            desc = str(kwargs.get("desc") or "")
            super().__init__(*args, **kwargs)
            if progress is None or desc.startswith("Downloading bytes"):
                return
            if "files" in desc:
                self._kind, text = "files", f"{label} files"
            else:
                self._kind, text = "bytes", label
            self._task = progress.add_task(text, total=self.total or None, kind=self._kind)

        def display(self, msg: str | None = None, pos: int | None = None) -> bool:
            return True

        def _push(self) -> None:
            if self._task is not None:
                progress.update(self._task, completed=self.n, total=self.total or None)

        def update(self, n: float | None = 1) -> bool | None:
            result = super().update(n)
            self._push()
            return result

        def refresh(self, *args: Any, **kwargs: Any) -> None:
            self._push()

        def close(self) -> None:
            self._push()
            super().close()

    return RichTqdm


def rich_progress(stream: Any):
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )
    from rich.text import Text

    class ByKind(ProgressColumn):
        """Bytes columns for byte bars, "3/7" for the file count."""

        def __init__(self, for_bytes: ProgressColumn, for_files: ProgressColumn | None) -> None:
            super().__init__()
            self.for_bytes, self.for_files = for_bytes, for_files

        def render(self, task):
            if task.fields.get("kind") == "files":
                return self.for_files.render(task) if self.for_files else Text("")
            return self.for_bytes.render(task)

    return Progress(TextColumn("{task.description}"), BarColumn(),
                    ByKind(DownloadColumn(), MofNCompleteColumn()), ByKind(TransferSpeedColumn(), None),
                    ByKind(TimeRemainingColumn(), None),
                    console=Console(file=stream), transient=True)
