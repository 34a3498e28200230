"""Host-side building blocks every other part uses: loops compiled to run without the GIL,
sorting, row copies, thread priorities, progress bars, the loss and batch guards, and the
registry of environment switches. Nothing here imports another part of the package."""
