"""Small helpers with no offspec dependencies but errors: paths, files, threads, devices, sizes."""
