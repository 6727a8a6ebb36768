"""Which content format a chat template expects, decided from its source as vLLM 0.32
decides it, so a message's content reaches our render in the shape it reaches vLLM's.

* ``"openai"``: the template loops over a message's content, so it is handed the content
  as a list of parts (``[{"type": "text", "text": ...}]``, a string content wrapped as one
  part);
* ``"string"``: anything else (no such loop, no template, a template that does not
  parse); a message's text parts are joined with ``"\\n"`` into one string first.

A loop over content is a ``{% for %}`` whose iterable is, under any filters, tests and
slices, ``M.content`` or ``M['content']`` for a loop variable ``M`` over the messages
(``messages`` or a name set from it: ``{% set msgs = messages[1:] %}``), a bare
``content`` outside a macro, or a macro parameter that some call of the macro is given
``M.content``. An engine started with ``--chat-template-content-format`` other than
``auto`` uses that instead: the same setting exists here (see the registry).
"""

from __future__ import annotations

__all__ = ["OPENAI", "STRING", "content_format", "generation_tag"]

STRING = "string"
OPENAI = "openai"


def content_format(source: str | None) -> str:
    """:data:`OPENAI` or :data:`STRING` for a template's source (see the module docstring)."""
    if not source:
        return STRING
    import jinja2
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", generation_tag()])
    try:
        tree = env.parse(source)
    except jinja2.TemplateSyntaxError:
        return STRING
    aliases = _aliases(tree, nodes)
    loop_vars = {f.target.name for f in tree.find_all(nodes.For)
                 if isinstance(f.target, nodes.Name) and _name(f.iter, nodes) in aliases}
    loops = tree.find_all(nodes.For)
    return OPENAI if any(_over_content(f, loop_vars, tree, nodes) for f in loops) else STRING


def generation_tag() -> type:
    """The ``{% generation %}...{% endgeneration %}`` extension (the assistant-mask
    markers of ``transformers``' templates): renders its body as it is. Made on first
    use (jinja2 is optional)."""
    global _GENERATION
    if _GENERATION is None:
        from jinja2 import nodes
        from jinja2.ext import Extension

        class Generation(Extension):
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.Scope(body, lineno=lineno)

        _GENERATION = Generation
    return _GENERATION


_GENERATION: type | None = None


def _unwrap(node, nodes):
    """The expression under filters, tests and slices (``x | f``, ``x is t``, ``x[a:b]``)."""
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            return node


def _name(node, nodes) -> str | None:
    """The variable an expression reads, through filters, tests and slices (None if it
    is not a plain variable)."""
    node = _unwrap(node, nodes)
    return node.name if isinstance(node, nodes.Name) else None


def _aliases(tree, nodes) -> set[str]:
    """``messages`` and every name assigned from it (through filters, tests and slices),
    transitively."""
    out = {"messages"}
    grew = True
    while grew:
        grew = False
        for assign in tree.find_all(nodes.Assign):
            if isinstance(assign.target, nodes.Name) and assign.target.name not in out \
                    and _name(assign.node, nodes) in out:
                out.add(assign.target.name)
                grew = True
    return out


def _is_content_of(node, loop_vars: set[str], nodes) -> bool:
    """``M.content`` or ``M['content']`` for a message loop variable ``M``."""
    node = _unwrap(node, nodes)
    if isinstance(node, nodes.Getattr):
        return node.attr == "content" and isinstance(node.node, nodes.Name) and node.node.name in loop_vars
    if isinstance(node, nodes.Getitem):
        return (isinstance(node.arg, nodes.Const) and node.arg.value == "content"
                and isinstance(node.node, nodes.Name) and node.node.name in loop_vars)
    return False


def _over_content(loop, loop_vars: set[str], tree, nodes) -> bool:
    """Whether a ``{% for %}`` iterates over a message's content."""
    iterable = loop.iter
    if _is_content_of(iterable, loop_vars, nodes):
        return True
    name = _name(iterable, nodes)
    if name is None:
        return False
    for macro in tree.find_all(nodes.Macro):
        params = [a.name for a in macro.args]
        if name in params and _inside(macro, loop):  # a parameter: what the calls pass
            return any(_macro_given_content(call, macro.name, name, params.index(name), loop_vars, nodes)
                       for call in tree.find_all(nodes.Call))
    return name == "content" and not any(_inside(m, loop) for m in tree.find_all(nodes.Macro))


def _inside(parent, node) -> bool:
    return any(n is node for n in parent.find_all(type(node)))


def _macro_given_content(call, macro: str, param: str, index: int, loop_vars: set[str], nodes) -> bool:
    """Whether ``call`` calls ``macro`` with ``M.content`` for ``param`` (by position or name)."""
    if not (isinstance(call.node, nodes.Name) and call.node.name == macro):
        return False
    if index < len(call.args) and _is_content_of(call.args[index], loop_vars, nodes):
        return True
    return any(kw.key == param and _is_content_of(kw.value, loop_vars, nodes) for kw in call.kwargs)
