"""Native C++ CPU kernels, built as Paddle custom operators on first use and cached (see ``build``)."""
