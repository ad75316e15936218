"""PARSE's verification (docs/design.md §2): segmentation of a draft into steps (segment, on the device;
host_segment: the same in numpy, on the host), packing prefixes and suffix copies into one block (block), judge
scores, acceptance and prefix scoring (scoring), and one verification round inside a program (round)."""
