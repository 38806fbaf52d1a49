"""Driving a ChatSession with typed keys: drive, and the Run and RecordingOutput it returns."""

from __future__ import annotations

from dataclasses import dataclass
from io import StringIO

from prompt_toolkit import PromptSession
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from dflash_cli.conversation import GenerationSettings
from dflash_cli.ui.chat import ChatSession
from dflash_cli.ui.render import Output


class RecordingOutput(Output):
    """Output into StringIO streams that also keeps the Steps of each reply it printed."""

    def __init__(self, color: str = "never"):
        super().__init__(color, stdout=StringIO(), stderr=StringIO())
        self.replies: list[list] = [[]]

    def text(self, step) -> None:
        self.replies[-1].append(step)
        super().text(step)

    def end_text(self) -> None:  # called once after every reply, finished or not
        if self.replies[-1]:
            self.replies.append([])
        super().end_text()


@dataclass
class Run:
    code: int
    session: ChatSession
    out: RecordingOutput

    @property
    def stdout(self) -> str:
        return self.out.out.getvalue()

    @property
    def stderr(self) -> str:
        return self.out.err.getvalue()

    @property
    def messages(self) -> list[dict]:
        return self.session.conversation.messages


def drive(runtime, keys: str, *, settings: GenerationSettings | None = None, color: str = "never",
          **kwargs) -> Run:
    """Types `keys` into a ChatSession (then closes the input, which reads as Ctrl-D) and runs it."""
    out = RecordingOutput(color)
    with create_pipe_input() as pipe:
        pipe.send_text(keys)
        pipe.close()
        session = ChatSession(runtime, out, settings or GenerationSettings(max_tokens=12),
                              session_factory=lambda **kw: PromptSession(input=pipe, output=DummyOutput(), **kw),
                              **kwargs)
        code = session.run()
    return Run(code, session, out)
