"""CLI spellings kept for one release: the ``error_feedback:`` section, which ``correction: {method: ef}`` replaced.

Staleness has two config sections, ``delay:`` (the cause) and ``correction:`` (the remedy). ``error_feedback:``
(``strength``, ``extrapolate_weight_decay``) is read into the ``correction:`` section before anything is built,
meaning what it meant when the recipes set Error Feedback through it: a strength given there replaces the strength
of an ``ef`` correction (0 switches Error Feedback off), ``extrapolate_weight_decay`` alone keeps the strength a
recipe gave, and Error Feedback beside another correction is refused as two corrections. The run then says how to
write it now.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_async.callbacks.delay import two_corrections

SECTION = "error_feedback"


@dataclass
class ErrorFeedbackSection:
    """The deprecated ``error_feedback:`` section: ``None`` where not given."""

    strength: float | None = None
    extrapolate_weight_decay: bool | None = None


def translate_error_feedback_section(config) -> str | None:
    """Move a given ``error_feedback`` section of ``config`` (a subcommand's parsed namespace) into its
    ``correction`` section; the deprecation message (with the new spelling), or ``None`` when it was not given.
    Raises ``ValueError`` when it switches Error Feedback on beside another correction."""
    section, correction = config.get(SECTION), config.get("correction")
    if section is None or correction is None or (section.strength is None and section.extrapolate_weight_decay is None):
        return None
    was_ef = correction.method == "ef"
    strength = section.strength if section.strength is not None else (correction.strength if was_ef else 0.0)
    strength = 1.0 if strength is None else float(strength)  # (an ef correction at its default strength)
    if strength < 0:
        raise ValueError(f"{SECTION}.strength must be >= 0, got {strength:g}.")
    if strength > 0 and correction.method not in ("ef", "none"):
        raise two_corrections(f"ef, {correction.method}")
    options = dict(correction.options or {}) if was_ef else {}
    if section.extrapolate_weight_decay is not None:
        options["extrapolate_weight_decay"] = bool(section.extrapolate_weight_decay)
    if strength > 0:
        correction.method, correction.strength, correction.options = "ef", strength, options
        given = ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items())
        spelled = "correction: {method: ef, strength: %g%s}" % (strength, f", options: {{{given}}}" if options else "")
    elif correction.method in ("ef", "none"):
        correction.method, correction.strength, correction.options = "none", None, {}
        spelled = "correction: {method: none}"
    else:
        spelled = f"nothing: Error Feedback is off and the correction is {correction.method!r}"
    return (f"The {SECTION}: section (--{SECTION}.*) is deprecated and goes in the next release: write {spelled} "
            "(the correction: section holds every staleness correction).")
