"""Former name of :mod:`pulsenet.loco.documents` (the round's store documents); old imports keep working."""

from pulsenet.loco.documents import *  # noqa: F403
