"""What a rank stands on: who it is in the MPI world (:mod:`.world`), its share of the node (:mod:`.system`,
:mod:`.allocator`), Slurm (:mod:`.slurm`), durable files (:mod:`.fsutil`), flat buffers (:mod:`.flat`), rank-0
decisions and failures (:mod:`.coordination`), whether the replicas are one model (:mod:`.replicas`), and the
start-up's parts, timed (:mod:`.startup`)."""
