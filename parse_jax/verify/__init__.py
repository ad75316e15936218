"""PARSE's verification (docs/design.md §2): segmentation of a draft into steps (layout: the numpy reference;
segment: the same on the device), packing prefixes and suffix copies into one block (block), judge scores and
acceptance (scoring), and one verification round inside a program (round)."""
