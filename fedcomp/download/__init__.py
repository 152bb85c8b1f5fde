"""The compressed download: how the server sends the global model to the nodes and how a node rebuilds
it, both sides in one package (Flower-level, no app).

Read in the order the model travels:

- `options`: `Download`, the download's settings as the strategy takes them.
- `layout`: what a message holds (the compressed part as one flat vector, the exempt BatchNorm
  statistics and their sign-coded changes, chained payloads, per-tensor steps) and the digest of a copy.
- `shared_step`: a secure round's k summed values and its seed as a step (the SecAgg+ path).
- `seeded_init`: initial weights a node rebuilds from a seed and one rule per tensor.
- `first_contact`: which start a node that holds nothing gets (seeded, compressed, dense).
- `sender`: `Downstream`, the server side: the broadcast model with server-side error feedback and,
  per node, the cheapest message (a `Plan`).
- `node_copies`: `NodeCopies`, what the server knows each node holds, within a copy budget.
- `correction`: counting an update from the global model rather than the copy its node trained from.
- `receiver`: the node side: rebuild the model a message describes, check it, keep the copy and report
  its digest.

Source: Sattler et al., "Robust and Communication-Efficient Federated Learning from Non-IID Data",
IEEE TNNLS 2019 (compression in both directions, residuals on both sides, caching for clients that
missed rounds).
"""

from fedcomp.download.options import Download
from fedcomp.download.receiver import check_download, check_version, rebuild, report_copy
from fedcomp.download.sender import Downstream

__all__ = ["Download", "Downstream", "check_download", "check_version", "rebuild", "report_copy"]
