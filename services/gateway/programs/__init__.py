"""`POST /v1/programs`: run a traced language-model program (lang_client's IR, version 1) server-side.

The IR is data, never code. Three modules own one step each:
  ir.py        the request's IR (its ops), the validated Program and ProgramLimits;
  validate.py  request JSON -> Program: closed schema, limits, args bound, reads resolved;
  execute.py   Program -> answer: a small async interpreter over an injected generate(body).
This module is their public face (what api/programs.py and tests import).

Request body: {"program": IR, "args": {name: str}, "stream": bool}
Answer: {"text", "messages", "variables": {scoped name: value}, "meta_info": {scoped name: meta}}
Scoped names: "name" in the main stream, "f<fork id>.<branch>.name" inside a fork branch.
Streaming: {"type": "variable", "name", "value", "meta_info"} per variable as it completes, then
{"type": "result", ...the answer}.
"""
from __future__ import annotations

from services.gateway.programs.execute import ProgramError, execute_program, stream_program
from services.gateway.programs.ir import ProgramLimits
from services.gateway.programs.validate import parse_program_request, validate_program

__all__ = ["ProgramError", "ProgramLimits", "execute_program", "parse_program_request", "stream_program",
           "validate_program"]
