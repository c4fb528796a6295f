"""A site installation of hpctrain (``make install PREFIX=...``), one for every user of a cluster.

* :mod:`.record`: what it was built against (``PREFIX/share/hpctrain/install.json``), found from
  the running interpreter, and compared with the MPI and modules loaded now (``hpctrain doctor``);
* :mod:`.modulefiles`: the Lmod (Lua) and Environment Modules (Tcl) modulefiles;
* ``python -m hpctrain.install``: writes both, at the end of ``scripts/install.sh``.
"""
