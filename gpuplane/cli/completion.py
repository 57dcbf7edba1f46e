"""`gpuplane completion bash|zsh`: a completion script generated from the parser itself,
so every command and option (including those other modules add) completes.

Why not argcomplete or shtab: argcomplete runs `gpuplane` on every Tab (importing the
package each time) and needs a global hook or an eval per command; shtab writes static
scripts as this does, but would be one more dependency beyond the design card's list for
what 100 lines do. docs/cli.md says the same.
"""

import argparse

from .common import EXIT_OK, command


def add_parser(subparsers):
    p = command(subparsers, "completion",
                "print a shell completion script: eval \"$(gpuplane completion bash)\"")
    p.add_argument("shell", choices=["bash", "zsh"], help="the shell to complete in")
    p.set_defaults(func=cmd_completion)


def walk(parser, path=()):
    """Yield (path, subcommands, options, {option: choices}) for every (sub)parser."""
    subs, opts, choices = {}, [], {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            subs.update(action.choices)
        elif action.option_strings:
            if action.help == argparse.SUPPRESS:
                continue
            opts.extend(o for o in action.option_strings if o.startswith("--") or len(o) == 2)
            if action.choices:
                for o in action.option_strings:
                    choices[o] = [str(c) for c in action.choices]
        elif action.choices:                      # a positional with choices
            choices[""] = [str(c) for c in action.choices]
    yield path, sorted(subs), sorted(set(opts)), choices
    for name, sub in subs.items():
        yield from walk(sub, path + (name,))


def _table(parser):
    words, chosen = [], []
    for path, subs, opts, choices in walk(parser):
        key = " ".join(("gpuplane",) + path)
        words.append((key, " ".join(subs + opts)))
        for opt, values in choices.items():
            chosen.append((f"{key}|{opt}", " ".join(values)))
    return words, chosen


BASH = r'''# gpuplane completion for bash, generated from its parser: eval "$(gpuplane completion bash)"
_gpuplane_complete() {
  local cur prev cmdpath w i
  declare -A table=(
%(words)s
  )
  declare -A choices=(
%(choices)s
  )
  cur="${COMP_WORDS[COMP_CWORD]}"
  prev="${COMP_WORDS[COMP_CWORD-1]}"
  cmdpath="gpuplane"
  for ((i = 1; i < COMP_CWORD; i++)); do
    w="${COMP_WORDS[i]}"
    [[ "$w" == "--" ]] && return 0          # the job's own command: nothing to offer
    if [[ -n "${table["$cmdpath $w"]+x}" ]]; then cmdpath="$cmdpath $w"; fi
  done
  if [[ -n "${choices["$cmdpath|$prev"]+x}" ]]; then
    COMPREPLY=($(compgen -W "${choices["$cmdpath|$prev"]}" -- "$cur"))
  elif [[ "$cur" != -* && -n "${choices["$cmdpath|"]+x}" ]]; then
    COMPREPLY=($(compgen -W "${choices["$cmdpath|"]}" -- "$cur"))
  else
    COMPREPLY=($(compgen -W "${table["$cmdpath"]}" -- "$cur"))
  fi
}
complete -o default -F _gpuplane_complete gpuplane gpuctl
'''

ZSH = r'''#compdef gpuplane gpuctl
# gpuplane completion for zsh, generated from its parser: eval "$(gpuplane completion zsh)"
_gpuplane_complete() {
  local -A table choices
  table=(
%(words)s
  )
  choices=(
%(choices)s
  )
  local cmdpath="gpuplane" w i prev="${words[CURRENT-1]}"
  for ((i = 2; i < CURRENT; i++)); do
    w="${words[i]}"
    [[ "$w" == "--" ]] && return 0
    if (( ${+table[$cmdpath $w]} )); then cmdpath="$cmdpath $w"; fi
  done
  if (( ${+choices[$cmdpath|$prev]} )); then
    compadd -- ${=choices[$cmdpath|$prev]}
  elif [[ "$PREFIX" != -* ]] && (( ${+choices[$cmdpath|]} )); then
    compadd -- ${=choices[$cmdpath|]}
  else
    compadd -- ${=table[$cmdpath]}
  fi
}
compdef _gpuplane_complete gpuplane gpuctl
'''


def script(shell, parser):
    words, chosen = _table(parser)

    def pairs(items):
        return "\n".join(f"    [{_quote(k)}]={_quote(v)}" if shell == "bash"
                         else f"    {_quote(k)} {_quote(v)}" for k, v in items)
    template = BASH if shell == "bash" else ZSH
    return template % {"words": pairs(words), "choices": pairs(chosen)}


def _quote(text):
    return "'" + text.replace("'", "'\\''") + "'"


def cmd_completion(args):
    from . import get_parser
    print(script(args.shell, get_parser()), end="")
    return EXIT_OK
