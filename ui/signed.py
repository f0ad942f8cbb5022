"""The Studio as the UI's events see it: each event acts as the user signed in to its page.

Every UI module gets a ``Signed`` in place of the Studio. Whatever touches someone's work (the
Studio's ``OWNED`` methods: jobs, previews, outputs, the gallery) goes through ``studio.of(request)``,
the Studio as that event's user sees it (backend/users.py: a user sees their own work, an admin
everyone's). Called directly on a server with credentials, an OWNED method raises instead of acting
for no one in particular, so a handler that forgets the user fails in the tests rather than showing
one user another's jobs. Without credentials (a local, single-user server) both ways are the Studio.
"""
from __future__ import annotations

from typing import Callable

from backend.service import NOBODY, OWNED


class Signed:
    def __init__(self, studio, who: Callable[[str | None], object] | None = None):
        """``who(username)``: the identity behind a session's user name (None when there is none);
        ``who`` None: a server without credentials."""
        self._studio, self._who = studio, who

    @property
    def studio(self):
        return self._studio

    def of(self, request):
        """The Studio as the user of this event (its ``gr.Request``) sees it."""
        if self._who is None:
            return self._studio
        user = self._who(getattr(request, "username", None) if request is not None else None)
        return self._studio.for_user(user if user is not None else NOBODY)  # no one: sees nothing

    def __getattr__(self, name):
        if name in OWNED and self._who is not None:
            raise RuntimeError(f"Studio.{name} acts on someone's work: call it as studio.of(request).{name}")
        return getattr(self._studio, name)
