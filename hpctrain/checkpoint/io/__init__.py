"""A checkpoint's bytes on disk: writing a plan into one HDF5 file through MPI-IO (or by rank 0 alone),
reading and verifying it, tuned for the file system it goes to. Nothing here knows of runs, policies or the
checkpoint directory. Lowest first:

    agreement   how every rank of a collective read or write comes to raise the same CheckpointError
    directio    a rank's parts written and re-read past the page cache (``O_DIRECT``)
    mapped      a rank's parts written through a shared mapping of the file (space allocated first)
    iosettings  alignment, MPI-IO hints, direct or mapped writes, chosen from the directory's file system
    h5file      the HDF5 file: created with hints, layout and collective metadata; laid out, sealed, closed
    writer      who writes what, when: collective and independent calls, checksums, the serial fallback
    reader      the header; ``read``, the one read path that carries out any ReadPlan (checksums, NaN checks,
                agreement); verification: every checksum re-read and compared
"""
