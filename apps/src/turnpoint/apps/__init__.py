"""The applications built on turnpoint's libraries: the ``turnpoint`` command, the demo,
the bench and the example Gym participants.

This package sits on top: it may import any library's public face, and no library
(``turnpoint`` core, ``turnpoint.participant_sdk``, ``turnpoint.server``,
``turnpoint.trainer``) imports it. ``tests/unit/test_layers.py`` enforces that.
"""
