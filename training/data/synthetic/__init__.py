"""The embedded benchmark: synthetic scenes of coloured shapes, their captions, and an oracle that
decides for any caption and any scene whether the scene satisfies the caption.

Public entry points: :func:`generate.write_dataset`, :class:`generate.DistractorStream`,
:func:`parse.parse_caption`, :func:`relevance.is_relevant`, :func:`relevance.relevance_matrix`.
"""
