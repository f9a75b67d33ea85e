"""Replica and service URLs: validation, credentials, and a replica's P/D role fragment.

Owns: :func:`url_problem` (why a configured URL is refused), :func:`mask_url_password` and
:func:`redacted` (forms fit to show), :func:`strip_url_credentials`, and the ``#role=``
fragment a replica's URL may carry (:data:`ROLES`, :func:`split_role`, :func:`strip_role`).
Pure functions of strings; imports nothing of the router, so the configuration and the
replica set both read it.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit, urlunsplit

# query parameters whose value is a secret (redis-py takes any query parameter as a
# connection argument: ``redis://host/0?password=...``)
_SECRET_PARAMS = ("pass", "secret", "token", "key", "auth")
ESCAPES = "percent-escape it (% as %25, @ as %40, # as %23, / as %2F, ? as %3F, : as %3A)"


def redacted(url: str) -> str:
    """A form of a URL that may not parse, fit to show: everything up to its last ``@`` and
    its query go (either could hold a credential)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<URL>"
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    return f"{scheme}://{rest.split('?', 1)[0]}"


def _unambiguous(url: str) -> bool:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError on a port that is not a number)
    except ValueError:
        return False
    return "@" not in parts.path + parts.query + parts.fragment


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be parsed unambiguously (a credential holding an unescaped ``#``,
    ``/``, ``?``; a bad port; no host; a fragment), or None. The message shows the URL
    masked and tells how to escape."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError on a port that is not a number)
    except ValueError as e:
        return (f"{redacted(url)!r} cannot be parsed ({e}): if the user name or password "
                f"holds a reserved character, {ESCAPES}")  # fmt: skip
    if "@" in parts.path or "@" in parts.query or "@" in parts.fragment:
        return (f"{redacted(url)!r} is ambiguous: an '@' follows a '/', '?' or '#', so the "
                f"credentials end where they should not; in the user name or password, "
                f"{ESCAPES}")  # fmt: skip
    if parts.fragment or url.endswith("#"):
        return f"{mask_url_password(url)!r} has a fragment ('#'); in a password, {ESCAPES}"
    if not parts.hostname:
        return f"{mask_url_password(url)!r} has no host"
    return None


def mask_url_password(url: str) -> str:
    """``redis://user:secret@host/0?password=x`` -> ``redis://user:***@host/0?password=***``
    (for repr, logs, admin): the password of the user info and the values of secret-looking
    query parameters, found by parsing; a URL that does not parse unambiguously is shown
    without what precedes its last ``@`` and without its query."""
    if not _unambiguous(url):
        return redacted(url)
    parts = urlsplit(url)
    out = url
    if parts.password is not None:
        user = parts.netloc.rsplit("@", 1)[0].split(":", 1)[0]
        netloc = f"{user}:***@{parts.netloc.rsplit('@', 1)[1]}"
        out = out.replace(parts.netloc, netloc, 1)
    if parts.query:
        pairs = []
        for pair in parts.query.split("&"):
            name, eq, _ = pair.partition("=")
            secret = any(w in unquote(name).lower() for w in _SECRET_PARAMS)
            pairs.append(f"{name}=***" if eq and secret else pair)
        head, _, _ = out.partition("?")
        out = f"{head}?{'&'.join(pairs)}" + (f"#{parts.fragment}" if parts.fragment else "")
    return out


def strip_url_credentials(url: str) -> str:
    """``http://user:secret@host:8000/x`` -> ``http://host:8000/x``: the form a URL takes
    wherever it is shown (names, metrics labels, admin views, logs). Parsed; a URL that does
    not parse unambiguously (refused at start-up, :func:`url_problem`) loses everything up to
    its last ``@`` and its query."""
    if not _unambiguous(url):
        return redacted(url).replace("***@", "")
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


ROLES = ("prefill", "decode", "both")


def split_role(url: str) -> tuple[str, str]:
    """``http://h:8000#role=prefill`` -> (``http://h:8000``, ``"prefill"``): a replica's P/D
    role rides on its configured URL as a trailing ``#role=`` fragment (never sent: a fragment
    is not part of a request). Without one: the URL unchanged and ``"both"`` (any other
    fragment stays, for :func:`url_problem` to refuse). Raises ValueError on an unknown role."""
    base, sep, frag = url.rpartition("#")
    if not sep or not frag.startswith("role="):
        return url, "both"
    role = frag[len("role=") :]
    if role not in ROLES:
        raise ValueError(f"replica role must be prefill, decode or both, not {role!r}")
    return base, role


def strip_role(url: str) -> str:
    """``url`` without its ``#role=`` fragment (never raises: for names and credentials)."""
    base, sep, frag = url.rpartition("#")
    return base if sep and frag.startswith("role=") else url
