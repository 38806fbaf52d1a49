"""`dflash-cli chat`: a prompt_toolkit REPL speaking ollama's /command dialect.

Replies stream as plain text to stdout through `Output` (which colours provenance); everything else
goes to stderr. `Conversation` keeps the engine caches between turns, so a turn only prefills its new
tokens. Prompt, then stream, then prompt again: no patch_stdout (it breaks rich's colours).
"""

from __future__ import annotations

import base64
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prompt_toolkit import PromptSession
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings

from dflash_cli import settings as S
from dflash_cli.ui import signals
from dflash_cli.ui.render import Output, OutputClosed, isatty, status_text
from dflash_cli.ui.stats_text import stats_block, summary_line

if TYPE_CHECKING:
    from dflash_cli.runtime import Runtime

EXIT_OK, EXIT_USAGE, EXIT_INTERRUPTED = 0, 2, 130
NOT_A_TERMINAL = ("chat needs a terminal on stdin and stdout; for piped input or output use "
                  "`dflash-cli generate` (it reads the prompt from stdin)")
INTERRUPTED = "(interrupted: the partial reply stays in the conversation; /regen to retry)"
EXIT_HINT = "Use /bye or Ctrl-D to exit (Ctrl-C twice quickly also exits)"
HELP = '''Available commands:
  /set system TEXT            Set the system prompt (no TEXT: remove it)
  /set parameter NAME VALUE   temperature, top_p, top_k, max_tokens (num_predict), block_size, seed
  /set verbose | quiet        Statistics block / nothing after each reply
  /set think | nothink        Turn the model's thinking mode on or off
  /set format json | text     Replies are one JSON value / free text (also: /set schema SCHEMA,
                              /set grammar FILE, /set regex RE)
  /set hidethinking | showthinking   Leave the reasoning out of replies, or show it (dimmed)
  /set provenance | noprovenance   Colour drafted-and-accepted tokens apart from the target's own
  /show info | parameters | system
  /stats                      Statistics of the last reply
  /regen                      Drop the last reply and answer again (a set seed moves to the next)
  /clear                      Forget the conversation (the system prompt stays)
  /save FILE, /load FILE      Save or continue a conversation (JSON)
  /read FILE [TEXT]           Send a file's content, followed by TEXT if given
  /edit [TEXT]                Write the message in $EDITOR (or press Ctrl+G while typing)
  /copy                       Copy the last reply to the clipboard (OSC 52)
  /bye, /exit                 Exit (or Ctrl-D)
  /?, /help                   This help

Use """ to begin and end a multi-line message; pasted text is sent as one message.'''
COMMANDS = {"/?": "help", "/help": "help", "/bye": "bye", "/exit": "bye", "/clear": "clear", "/regen": "regen",
            "/set": "set", "/show": "show", "/stats": "stats", "/save": "save", "/load": "load",
            "/read": "read", "/edit": "edit", "/copy": "copy"}
# name -> (GenerationSettings field, parser, check, what a valid value looks like)
PARAMETERS: dict[str, tuple[str, Callable, Callable, str]] = {
    "temperature": ("temperature", float, lambda v: v >= 0, "a number >= 0 (0 = greedy)"),
    "top_p": ("top_p", float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "top_k": ("top_k", int, lambda v: v >= 0, "an integer >= 0 (0 = off)"),
    "max_tokens": ("max_tokens", int, lambda v: v >= 1, "an integer >= 1"),
    "num_predict": ("max_tokens", int, lambda v: v >= 1, "an integer >= 1"),
    "block_size": ("block_size", int, lambda v: v >= 1, "an integer from 1 to the drafter's block size, or none"),
    "seed": ("seed", int, lambda v: True, "an integer, or none"),
}


class SafeFileHistory(FileHistory):
    """FileHistory that never raises: a failing read or write is remembered (and reported) instead.

    The first line of a \"\"\" block is not kept: the whole block is, once it ends (ChatSession._read)."""

    error: OSError | None = None

    def append_string(self, string: str) -> None:
        if not is_block_opening(string):
            super().append_string(string)

    def load_history_strings(self):
        try:
            return list(super().load_history_strings())
        except OSError as e:
            self.error = e
            return []

    def store_string(self, string: str) -> None:
        try:
            if self.error is None:
                super().store_string(string)
        except OSError as e:
            self.error = e


def is_block_opening(line: str) -> bool:
    """True for the line that starts a \"\"\" block without ending it."""
    text = line.strip()
    return text.startswith('"""') and not (len(text) >= 6 and text.endswith('"""'))


def open_history(out: Output, path: Path | None = None) -> History:
    """The persistent input history; an in-memory one (and a warning) when the file cannot be used.

    A damaged file (not UTF-8, a NUL, lines not in FileHistory's format) is moved aside, never deleted,
    and a new one is started: its entries would otherwise come back with the Up arrow."""
    path = path or S.history_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        damage = history_damage(path.read_bytes()) if path.exists() else None
        if damage is not None:
            aside = _free_name(path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"))
            path.rename(aside)
            out.warn(f"the chat history file {path} is damaged ({damage}): moved it to {aside.name} "
                     "and started a new one")
        with open(path, "ab"):
            pass
    except OSError as e:
        out.warn(f"cannot use the chat history file {path} ({e.strerror or e}): continuing without history")
        return InMemoryHistory()
    return SafeFileHistory(str(path))


def history_damage(data: bytes) -> str | None:
    """What is wrong with the bytes of a history file, or None when they are what FileHistory writes."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"bytes that are not UTF-8 at offset {e.start}"
    if "\0" in text:
        return "a NUL character"
    for number, line in enumerate(text.split("\n"), 1):
        if line and line[0] not in "#+":
            return f"line {number} is not a history entry"
    return None


def _free_name(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}-{n}"), n + 1
    return candidate


class ChatSession:
    """The REPL: reads input with prompt_toolkit, runs /commands, streams replies.

    `session_factory(**kwargs)` builds the PromptSession; tests pass one that adds a pipe input and a
    DummyOutput. `run()` is the loop, `handle(line)` runs one line of input.
    """

    def __init__(self, runtime: Runtime, out: Output, settings: Any, *, system: str | None = None,
                 history: History | None = None, session_factory: Callable[..., PromptSession] = PromptSession,
                 verbose: bool = False, quiet: bool = False, double_interrupt_seconds: float = 1.0):
        self.runtime, self.out, self.settings = runtime, out, settings
        self.conversation = runtime.conversation(system)
        self.history = history if history is not None else InMemoryHistory()
        self.session_factory = session_factory
        self.verbose, self.quiet = verbose, quiet
        self.double_interrupt_seconds = double_interrupt_seconds
        self.last_stats: Any = None
        self.last_wall = 0.0
        self._last_interrupt = -math.inf
        self._prefix_edited = False  # /set system or /load since the last reply: a re-read is expected
        self._history_warned = False
        self._edit_next: str | None = None

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> int:
        """Prompts until /bye or Ctrl-D (0) or a double Ctrl-C (130); returns the exit code."""
        self.banner()
        prompt = self.session_factory(history=self.history, key_bindings=self._key_bindings(),
                                      placeholder=self._placeholder())
        self._more = self.session_factory(history=InMemoryHistory())  # block lines: kept out of the history
        while True:
            try:
                text, literal = self._read(prompt)
            except KeyboardInterrupt:
                if signals.received is not None:  # SIGTERM or SIGHUP: prompt_toolkit has restored the terminal
                    return signals.exit_code()
                now = time.monotonic()
                if now - self._last_interrupt < self.double_interrupt_seconds:
                    return EXIT_INTERRUPTED
                self._last_interrupt = now
                self.out.info(EXIT_HINT)
                continue
            except EOFError:
                return EXIT_OK
            self._last_interrupt = -math.inf
            self._check_history()
            try:
                code = self.send(text) if literal else self.handle(text)
            except KeyboardInterrupt:  # outside a reply (a command, the lines after a reply): back to the prompt
                self.out.info("(interrupted)")
                code = None
            except OutputClosed:
                return EXIT_OK
            if signals.received is not None:
                return signals.exit_code()
            if code is not None:
                return code

    def _read(self, prompt: PromptSession) -> tuple[str, bool]:
        """One message: a line, or a \"\"\" block (returned as literal text, never a command)."""
        edit, self._edit_next = self._edit_next, None
        def open_editor() -> None:
            prompt.default_buffer.open_in_editor(validate_and_handle=True)

        line = prompt.prompt(">>> ", default=edit or "", pre_run=None if edit is None else open_editor)
        if not line.lstrip().startswith('"""'):
            return line, False
        body = line.lstrip()[3:]
        lines = []
        while not body.rstrip().endswith('"""'):
            lines.append(body)
            body = self._more.prompt("... ")
        lines.append(body.rstrip()[:-3])
        text = "\n".join(lines).strip("\n")
        if "\n" in text:  # the whole block, recalled as one entry (Enter sends it as a block again)
            self.history.append_string(f'"""{text}"""')
        return text, True

    def _key_bindings(self) -> KeyBindings:
        kb = KeyBindings()

        @kb.add("c-c")
        def _(event):  # with text: clear the line; at an empty prompt: KeyboardInterrupt (hint / exit)
            if event.current_buffer.text:
                event.current_buffer.reset()
            else:
                event.app.exit(exception=KeyboardInterrupt, style="class:aborting")

        @kb.add("c-g")
        def _(event):
            event.current_buffer.open_in_editor(validate_and_handle=True)

        return kb

    def _placeholder(self):
        """A grey hint in the empty prompt, gone from the line that stays on screen once input ends."""
        from prompt_toolkit.application import get_app

        hint = [("fg:ansibrightblack", "Send a message (/? for help)")]
        return (lambda: [] if get_app().is_done else hint) if self.out.color_out else None

    def _check_history(self) -> None:
        error = getattr(self.history, "error", None)
        if error is not None and not self._history_warned:
            self._history_warned = True
            self.out.warn(f"the chat history file failed ({error.strerror or error}): history is not saved")

    def banner(self) -> None:
        self.out.info(f"dflash-cli chat · {self.runtime.banner()} · /? for help · /bye or Ctrl-D to exit", dim=False)
        if self.runtime.marks_drafted:
            self.out.legend()

    # -- input --------------------------------------------------------------------------------------
    def handle(self, line: str) -> int | None:
        """Runs one line: a /command or a message. Returns an exit code when the REPL should end."""
        text = line.strip()
        if not text:
            return None
        if text.startswith("/") and "\n" not in text:
            word, _, args = text.partition(" ")
            name = COMMANDS.get(word)
            if name is None:
                self.out.info(f"Unknown command '{word}'. Type /? for help", dim=False)
                return None
            return getattr(self, f"cmd_{name}")(args.strip())
        return self.send(text)

    def send(self, text: str) -> int | None:
        """Sends a user message and streams the reply."""
        if text.strip():
            self._reply(lambda: self.conversation.ask(text.strip(), self.settings))
        return None

    # -- replies ------------------------------------------------------------------------------------
    def _reply(self, start: Callable) -> None:
        """Streams one reply; Ctrl-C keeps the partial reply, an error keeps the chat going."""
        conv, out = self.conversation, self.out
        before = list(conv.messages)
        status = None if self.quiet else out.status_line()
        steps, last, error, interrupted = None, None, None, False
        started = time.perf_counter()
        try:
            steps = start()
            if self.runtime.first_token_wait:  # a server's queue and prefill: the wait is shown
                steps = out.until_first(steps, self.runtime.first_token_wait)
            out.begin_reply(conv.reply_in_thinking, conv.reply_markers)
            for step in steps:
                last = step
                out.text(step)
                if status is not None:
                    status.update(status_text(step.stats, self.runtime.speculative, out.color_err))
        except KeyboardInterrupt:
            interrupted = True
        except OutputClosed:
            raise
        except Exception as e:  # reported below; the REPL goes on
            error = e
        finally:
            if steps is not None:
                steps.close()  # runs Conversation's bookkeeping now, not at garbage collection
            out.close_status()
        out.end_text()
        if error is not None:
            from dflash_cli.ui.errors import describe

            if S.debug_enabled():
                raise error
            if last is None:  # nothing was generated: the failed exchange leaves no trace
                conv.messages = before
            message, hint, _ = describe(error)
            out.error(message, hint)
            return
        if last is not None:
            self.last_stats, self.last_wall = last.stats, time.perf_counter() - started
        if interrupted:
            out.info(INTERRUPTED if signals.received is None else "interrupted", dim=False)
        elif last is not None and self.verbose:
            self.cmd_stats("")
            reread = self.reread_tokens(last.stats)
            if reread > 0 and not self._prefix_edited:
                out.info(f"note: {reread} earlier token(s) were read again: the chat template renders "
                         "earlier turns differently from the tokens that were generated", dim=False)
        elif last is not None and not self.quiet:
            out.info(summary_line(last.stats, self.runtime.speculative))
        self._prefix_edited = False

    def reread_tokens(self, stats: Any) -> int:
        """Prefilled tokens beyond the new ones (the anchor token is never cached, so it counts as new)."""
        cached = max(self.conversation.cached_before - 1, 0)
        return stats.prefilled_tokens - (stats.prompt_tokens - cached)

    # -- commands -----------------------------------------------------------------------------------
    def cmd_help(self, args: str) -> None:
        for line in HELP.splitlines():
            self.out.info(line, dim=False)

    def cmd_bye(self, args: str) -> int:
        return EXIT_OK

    def cmd_clear(self, args: str) -> None:
        self.conversation.clear()
        self.out.info("Cleared the conversation.")

    def cmd_regen(self, args: str) -> None:
        conv = self.conversation
        if not any(m["role"] == "user" for m in conv.messages):
            return self.out.error("nothing to regenerate yet")
        self._reply(lambda: conv.regenerate(self.settings))

    def cmd_set(self, args: str) -> None:
        key, _, value = args.partition(" ")
        value = value.strip()
        if key == "system":
            self.conversation.system = value or None
            self._prefix_edited = True
            self.out.info("Set system message." if value else "Removed the system message.")
        elif key == "parameter":
            name, _, raw = value.partition(" ")
            self.set_parameter(name, raw.strip())
        elif key in ("verbose", "quiet"):
            self.verbose, self.quiet = key == "verbose", key == "quiet"
            self.out.info(f"Set '{key}' mode.")
        elif key in ("format", "schema", "grammar", "regex"):
            self.set_format(key, value)
        elif key == "think" and self.settings.output_format is not None:
            self.out.error("a structured reply cannot think first", "/set format text, then /set think")
        elif key in ("think", "nothink") and self.runtime.supports_thinking() is None:  # a server's template
            self.settings.think = key == "think"
            self.out.info(f"Set '{key}' mode.")
        elif key in ("think", "nothink"):
            from dflash_cli.ui.opening import check_thinking

            before = self.runtime.thinking_mode(self.settings.think)
            self.settings.think = key == "think"
            changed = self.runtime.thinking_mode(self.settings.think) != before
            check_thinking(self.out, self.runtime, self.settings.think, chat_template=self.settings.chat_template,
                           drafter=changed)  # the drafter warning once, not at every repeated /set
            self.out.info(f"Set '{key}' mode.")
        elif key in ("hidethinking", "showthinking"):
            self.out.hide_thinking = key == "hidethinking"
            self.out.info(f"Set '{key}' mode.")
        elif key in ("provenance", "noprovenance"):
            if key == "provenance" and not self.out.color_out:
                return self.out.error("provenance colours need colour on stdout (a terminal, NO_COLOR unset, --color)")
            self.out.provenance = key == "provenance"
            self.out.info(f"Set '{key}' mode.")
        else:
            self.out.error(f"unknown /set option '{key}'" if key else "usage: /set OPTION [VALUE]",
                           "options: system, parameter, verbose, quiet, think, nothink, hidethinking, "
                           "showthinking, provenance, noprovenance, format, schema, grammar, regex")

    def set_format(self, key: str, value: str) -> None:
        """/set format|schema|grammar|regex: checked first; a bad one prints an error and changes nothing."""
        from dflash_cli.engine.output_format import OutputFormatError, parse_format_setting

        if not value and key != "format":
            return self.out.error(f"usage: /set {key} VALUE")
        try:
            fmt = parse_format_setting(key, value or "text")
            if fmt is not None:
                fmt.grammar()
        except OutputFormatError as e:
            return self.out.error(str(e), e.hint)
        if fmt is not None and self.settings.think:
            return self.out.error("a structured reply cannot think first", "/set nothink, then set the format")
        self.settings.output_format = fmt
        self.out.info(f"Replies follow {fmt.describe()}." if fmt else "Replies are free text.")

    def set_parameter(self, name: str, raw: str) -> bool:
        """Validates and applies one /set parameter; a bad name or value prints an error and changes nothing."""
        if not name or not raw or name not in PARAMETERS:
            self.out.error(f"unknown parameter '{name}'" if name and raw else "usage: /set parameter NAME VALUE",
                           "names: " + ", ".join(PARAMETERS))
            return False
        field, parse, check, expected = PARAMETERS[name]
        value: Any = None
        if not (field in ("seed", "block_size") and raw.lower() in ("none", "default")):
            try:
                value = parse(raw)
                ok = check(value) and (parse is int or math.isfinite(value))
            except ValueError:
                ok = False
            if not ok:
                self.out.error(f"invalid value for {name}: '{raw}' (expected {expected})")
                return False
        if field == "block_size" and not self._block_ok(value):
            return False
        setattr(self.settings, field, value)
        self.out.info(f"Set parameter '{name}' to '{raw}'.")
        return True

    def _block_ok(self, value: int | None) -> bool:
        """The runtime's block-size rule (a server chooses its own); its error said as one line, with a hint
        for this chat rather than for the command line."""
        from dflash_cli.engine.errors import InvalidSettingError

        try:
            self.runtime.check_block_size(value)
        except InvalidSettingError as error:
            trained, hint = self.runtime.trained_block_size, error.hint
            if trained is not None:
                hint = f"/set parameter block_size 1..{trained}, or none for {trained}"
            elif not self.runtime.speculative:
                hint = "start the chat with --draft DRAFTER (or a model the registry pairs with one)"
            self.out.error(str(error), hint)
            return False
        return True

    def cmd_show(self, args: str) -> None:
        if args == "info":
            self._aligned(self.runtime.info())
        elif args == "parameters":
            self._aligned({k: getattr(self.settings, f) for k, (f, *_) in PARAMETERS.items() if k != "num_predict"})
        elif args == "system":
            self.out.info(self.conversation.system or "(no system message)", dim=False)
        else:
            self.out.error(f"unknown /show option '{args}'" if args else "usage: /show OPTION",
                           "options: info, parameters, system")

    def _aligned(self, rows: dict) -> None:
        width = max(len(k) for k in rows) + 1
        for key, value in rows.items():
            shown = "none" if value is None else ", ".join(map(str, value)) if isinstance(value, list) else value
            self.out.info(f"  {key + ':':<{width}} {shown}", dim=False)

    def cmd_stats(self, args: str) -> None:
        if self.last_stats is None:
            return self.out.error("no reply yet: /stats shows the statistics of the last reply")
        for line in stats_block(self.last_stats, wall_seconds=self.last_wall):
            self.out.info(line, dim=False)

    def cmd_save(self, args: str) -> None:
        path = self._path_arg(args, "/save FILE")
        if path is None:
            return
        if path.exists() and not is_transcript(path):
            return self.out.error(f"{path} exists and is not a dflash-cli transcript: not overwriting it",
                                  "choose another file name")
        try:
            self.conversation.save(path, self.settings)
        except OSError as e:
            return self.out.error(f"cannot save to {path}: {e.strerror or e}")
        self.out.info(f"Saved {len(self.conversation.messages)} messages to {path}.")

    def cmd_load(self, args: str) -> None:
        from dflash_cli.engine.errors import DFlashError

        path = self._path_arg(args, "/load FILE")
        if path is None:
            return
        try:
            self.conversation.load(path)
        except DFlashError as e:
            return self.out.error(str(e), e.hint)
        self._prefix_edited = True
        self.out.info(f"Loaded {len(self.conversation.messages)} messages from {path}.")

    def cmd_read(self, args: str) -> None:
        path, text = self._path_arg(args, "/read FILE [TEXT]", rest=True)
        from dflash_cli.ui.prompt_input import NOT_UTF8, decode_utf8

        try:
            content, replaced = decode_utf8(path.read_bytes()) if path else ("", False)
        except OSError as e:
            return self.out.error(f"cannot read {path}: {e.strerror or e}")
        content = content.rstrip("\n")
        if replaced:
            self.out.warn(NOT_UTF8.format(what=str(path)))
        if path and not (content.strip() or text):
            self.out.error(f"{path} is empty: nothing sent")
        elif path:
            self.out.info(f"Sending {path} ({len(content)} characters)" + (" and your text." if text else "."))
            self.send("\n\n".join(p for p in (content, text) if p.strip()))

    def cmd_edit(self, args: str) -> None:
        self._edit_next = args  # the next prompt opens $EDITOR on it, as Ctrl+G does, and sends the result

    def cmd_copy(self, args: str) -> None:
        reply = next((m["content"] for m in reversed(self.conversation.messages) if m["role"] == "assistant"), "")
        if not reply:
            return self.out.error("no reply to copy yet")
        if not self.out.err_tty:
            return self.out.error("/copy needs a terminal: it asks the terminal to set the clipboard (OSC 52)")
        self.out.err.write(f"\x1b]52;c;{base64.b64encode(reply.encode()).decode()}\x07")
        self.out.info(f"Copied the last reply ({len(reply)} characters), if your terminal allows OSC 52.")

    def _path_arg(self, args: str, usage: str, rest: bool = False):
        """'FILE [TEXT]' or '"FILE WITH SPACES" [TEXT]' -> Path (and TEXT with rest=True); None: usage shown."""
        name, _, text = args.partition(" ")
        if args[:1] in ('"', "'") and args.find(args[0], 1) > 0:
            name, text = args[1:args.find(args[0], 1)], args[args.find(args[0], 1) + 1:]
        if not name:
            self.out.error(f"usage: {usage}")
        path = Path(name).expanduser() if name else None
        return (path, text.strip()) if rest else path


def is_transcript(path: Path) -> bool:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return isinstance(data, dict) and data.get("format") == "dflash-cli chat"
    except (OSError, ValueError):
        return False


def run_chat(out: Output, command: Any, *, history: bool, stdin: Any = None, stdout: Any = None) -> int:
    """The `chat` command's body (`command`: ui.options.CommandOptions): refuses non-terminals (exit 2), opens
    the model, runs the REPL."""
    import dataclasses

    from dflash_cli.ui.opening import check_format, check_thinking, open_model
    from dflash_cli.ui.prompt_input import system_prompt

    if not (isatty(stdin or sys.stdin) and isatty(stdout or sys.stdout)):
        out.error(NOT_A_TERMINAL)
        return EXIT_USAGE
    shown, settings = command.output, dataclasses.replace(command.settings)
    runtime = open_model(out, command.model, quiet=shown.quiet, settings=settings)
    try:
        check_format(settings)
        check_thinking(out, runtime, settings.think, chat_template=settings.chat_template)
        out.hide_thinking = shown.hide_thinking
        session = ChatSession(runtime, out, settings, system=system_prompt(out, command.system),
                              history=open_history(out) if history else None, verbose=shown.verbose,
                              quiet=shown.quiet)
        return session.run()
    finally:
        runtime.close()
