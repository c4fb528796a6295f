"""How a configuration value is typed: a TOML value or a ``key=value`` override's text, checked and converted
to its field's type (:func:`typed_value`); an override's value for a keyword argument (:func:`parse_literal`)."""
from ..errors import ConfigError

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_EXPECTED = {bool: "a boolean (true or false)", int: "an integer", float: "a number", str: "a string"}
_ACCEPTED = {bool: bool, int: int, float: (int, float), str: str}  # the TOML values each type takes
_EXAMPLES = {bool: "true", int: "10", float: "0.5", dict: "{width = 64}", list: '["src"]'}  # for a hint


class Switch(str):
    """The type of a key that is true, false, or ``"auto"`` (hpctrain decides at run time)."""


def _switch(value):
    """``value`` (TOML's, or an override's text) as True, False or "auto"; None if it is none of them."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    return True if text in _TRUE else False if text in _FALSE else "auto" if text == "auto" else None


def typed_value(value, kind, optional, name, source, from_text):
    """``value`` (TOML's, or with ``from_text`` an override's text) as the type ``kind`` of the key ``name``."""
    if kind in (dict, list):
        return _convert_table(value, kind, name, source, from_text)
    if kind is Switch:
        switched = _switch(value)
        if switched is None:
            raise ConfigError(f"{source}: {name} = {value!r} is not true, false or \"auto\"",
                              hint=f'give {name} true, false or "auto", e.g. {name}=false')
        return switched
    if from_text:
        text = value.strip()
        if optional and text.lower() in ("", "none", "null"):
            return None
        if kind is bool and text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        if kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        elif kind is not bool:  # a string, its quotes optional
            return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text
    elif value is None and optional:
        return None
    elif isinstance(value, _ACCEPTED[kind]) and (kind is bool or not isinstance(value, bool)):
        return float(value) if kind is float else value
    raise ConfigError(f"{source}: {name} = {value!r} is not {_EXPECTED[kind]}",
                      hint=f"give {name} {_EXPECTED[kind]}, e.g. {name}={_EXAMPLES.get(kind, 'name')}")


def parse_literal(text):
    """A ``key=value`` override's value for a keyword argument: a TOML literal (``64``, ``0.5``,
    ``true``, ``"text"``, ``[1, 2]``, ``{a = 1}``); anything that is not one is taken as a string.

    >>> parse_literal("1024"), parse_literal("[1, 2]"), parse_literal("gelu")
    (1024, [1, 2], 'gelu')
    """
    import tomllib

    try:
        return tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return text.strip()


def _convert_table(value, kind, name, source, from_text):
    """``dict`` fields (keyword arguments: any TOML values) and ``list`` fields (of strings)."""
    if from_text:
        text = value.strip()
        if kind is list and not text.startswith("["):
            value = [part.strip() for part in text.split(",") if part.strip()]  # a,b,c
        else:
            value = parse_literal(text)
    if kind is dict and not isinstance(value, dict):
        raise ConfigError(f"{source}: {name} = {value!r} is not a table of keyword arguments",
                          hint=f"write it as [{name}] with one key = value per line, or {name} = {{width = 64}}; "
                               f"one argument from the command line: {name}.width=64")
    if kind is list and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ConfigError(f"{source}: {name} = {value!r} is not a list of strings",
                          hint=f'e.g. {name} = ["src", "../shared"] (or {name}=src,../shared on the command line)')
    return dict(value) if kind is dict else list(value)
