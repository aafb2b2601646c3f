"""llama.cpp's logits kept in this repository and the scripts that wrote them (run as
`python -m tests.goldens.NAME` from the repository root)."""
