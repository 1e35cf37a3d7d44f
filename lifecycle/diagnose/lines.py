"""The shapes of the lines PyTorch, gloo, NCCL and torchrun print, taken from their source.

PyTorch (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, v2.6.0 to v2.13.0; TraceUtils.h; ProcessGroupGloo.cpp):

- log prefix ``[PG ID <id> PG GUID <guid>(<desc>) Rank <group rank>] `` (``logPrefix()``; older ``[PG <guid> Rank``);
- ``Watchdog caught collective operation timeout: WorkNCCL(SeqNum=<s>, OpType=<OP>, NumelIn=..., NumelOut=...,
  Timeout(ms)=...) ran for <ms> milliseconds before timing out.`` (after ``[Rank <group rank>] ``);
- ``failure detected by watchdog at work sequence id: <s> PG status: last enqueued work: <e>, last completed work:
  <c>`` (2.6+); ``Exception (either an error or timeout) detected by watchdog at work: <s>, last enqueued NCCL work:
  <e>, last completed NCCL work: <c>.`` and ``Timeout at NCCL work: ...`` (older);
- ``Received a dump signal due to a collective timeout from {this local rank | rank <r>} and we will try our best to
  dump the debug info. Last enqueued {NCCL|<backend>} work: <e>, last completed {NCCL|<backend>} work: <c>.``;
- the desync report (TraceUtils.h): ``ranks [<r>, ...] are the lagging ranks that caused this timeout``, ``[<r>]
  joined but didn't finish collective #<s>``, ``[<r>] finished collective #<s>, but didn't join collective #<s+1>``;
- ``[Rank <r>]: Ranks <r>, ... failed to pass monitoredBarrier in <ms> ms`` (ProcessGroupGloo.cpp);
- gloo (third_party/gloo transport/tcp): ``Timed out waiting <ms>ms for {send|recv} operation to complete``,
  ``Connection closed by peer [<addr>]:<port>``, ``Read error [<addr>]:<port>: Connection reset by peer``;
- the store: ``wait timeout after <ms>ms, keys: /default_pg/<n>//cpu//<m>/<rank>`` (the key of the rank whose
  address never came), ``Timed out after <s> seconds waiting for clients. <j>/<w> clients joined.``;
- torchrun's failure summary (``rank : <r> (local_rank: <l>)``, ``exitcode : <c> (pid: <p>)``, ``error_file``) and
  its agent (``Sending process <pid> closing signal SIGTERM``);
- NCCL (src/misc/socket.cc, src/transport/net_ib.cc): ``<host>:<pid>:<tid> [<dev>] NCCL WARN ...`` naming the
  peer ``<addr><port>``: ``Net : Connection closed by remote peer``, ``NET/IB : Got completion from peer``,
  ``Call to recv from <peer> failed``.

Each parser takes one line with the launcher's prefixes removed and returns the fields it found. Pure Python.
"""

from __future__ import annotations

import re

PG_PREFIX = re.compile(r"\[PG (?:ID (?P<pgid>\d+) PG GUID )?(?P<guid>[^\s(\]]+) ?(?:\((?P<desc>[^)]*)\))? "
                       r"Rank (?P<grank>\d+)\]")
WORK_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout: Work\w*\(SeqNum=(?P<seq>\d+), "
                          r"OpType=(?P<op>\w+)")
PG_STATUS = (
    re.compile(r"failure detected by watchdog at work sequence id: (?P<seq>\d+) PG status: last enqueued work: "
               r"(?P<enq>-?\d+), last completed work: (?P<done>-?\d+)"),
    re.compile(r"(?:detected by watchdog at work|Timeout at NCCL work): (?P<seq>\d+), last enqueued NCCL work: "
               r"(?P<enq>-?\d+), last completed NCCL work: (?P<done>-?\d+)"),
)
LAST_WORK = re.compile(r"[Ll]ast enqueued (?:\w+ )?work: (?P<enq>-?\d+), last completed (?:\w+ )?work: "
                       r"(?P<done>-?\d+)")
DESYNC = (
    re.compile(r"ranks \[(?P<ranks>[\d, ]+)\] are the lagging ranks that caused this timeout"),
    re.compile(r"\[(?P<ranks>[\d, ]+)\] joined but didn't finish collective #(?P<seq>\d+)"),
    re.compile(r"\[(?P<ranks>[\d, ]+)\] finished collective #(?P<seq>\d+), but didn't join collective #\d+"),
)
MONITORED = re.compile(r"Ranks? (?P<ranks>[\d, ]+) failed to pass monitoredBarrier in (?P<ms>\d+) ms")
STORE_KEYS = re.compile(r"wait timeout after (?P<ms>\d+)ms, keys: (?P<keys>\S+(?:, \S+)*)")
DEFAULT_KEY = re.compile(r"^/default_pg/\d+//\w+//\d+/(?P<rank>\d+)$")
CLIENTS = re.compile(r"waiting for clients\. (?P<joined>\d+)/(?P<world>\d+) clients joined")
NCCL_WARN = re.compile(r"^(?P<host>[\w.\-]+):(?P<pid>\d+):\d+ \[\d+\] (?:\S+:\d+ )?NCCL WARN (?P<msg>.*)$")
NCCL_PEER = re.compile(r"(?:peer|from|to) (?P<peer>[\w.\-:\[\]%]+<\d+>)")
GLOO_PEER = re.compile(r"(?:Connection closed by peer|Read error) \[(?P<peer>[^\]]+)\]:(?P<port>\d+)")
SUMMARY_RANK = re.compile(r"^\s*rank\s*: (?P<rank>\d+) \(local_rank: (?P<local>\d+)\)")
SUMMARY_HOST = re.compile(r"^\s*host\s*: (?P<host>\S+)\s*$")
SUMMARY_EXIT = re.compile(r"^\s*exitcode\s*: (?P<code>-?\d+) \(pid: (?P<pid>\d+)\)(?:\s+\((?P<sig>SIG\w+)\))?")
SUMMARY_ERRFILE = re.compile(r"^\s*error_file\s*: (?P<path>\S+)\s*$")
ROOT_CAUSE = re.compile(r"^Root Cause \(first observed failure\):")
AGENT_SIGNAL = re.compile(r"Sending process (?P<pid>\d+) closing signal (?P<sig>SIG\w+)")
EXCEPTION = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit|Failure))"
                       r"(?::\s?(?P<msg>.*))?$")
TERMINATE = re.compile(r"terminate called after throwing an instance of '(?P<type>[^']+)'")
WHAT = re.compile(r"^\s*what\(\):\s+(?P<msg>.*)$")
FRAME = re.compile(r'^\s*(?:File "(?P<file>[^"]+)", line \d+, in (?P<func>\S+)|#\d+ (?P<func2>\S+) from '
                   r'(?P<file2>\S+):\d+)')
ITERATION = re.compile(r"\biteration\s+(?P<it>\d+)\s*/\s*(?P<total>\d+)")
TRACEBACK = "Traceback (most recent call last):"

CONSEQUENCE = re.compile(
    r"[Tt]imed out|[Tt]imeout|TIMEOUT|Connection (?:closed|reset|refused)|closed by (?:remote )?peer|Broken pipe|"
    r"ECONNRESET|recvBytes|sendBytes|failed to recv|[Cc]ommunicator (?:was|is) aborted|Some NCCL operations have "
    r"failed|NCCL error|ncclRemoteError|ncclSystemError|DistNetworkError|DistBackendError|DistStoreError|"
    r"monitoredBarrier|[Ww]atchdog|SIGTERM|[Ss]ignal:? 15|KeyboardInterrupt|ChildFailedError|SignalException|"
    r"remote worker|[Aa]borted|process group .*destroyed")
"""An error that is the consequence of a peer, the network or the launcher, never a cause by itself."""

STAGES = (
    ("checkpoint", re.compile(r"checkpoint|dcp|dist_checkpointing|state_dict_saver|save_state_dict|\bsave\b|"
                              r"_save\b|write_data|finalize_async")),
    ("exit", re.compile(r"destroy_process_group|destroy_model_parallel|atexit|__del__|shutdown")),
    ("init", re.compile(r"init_process_group|new_group|initialize_model_parallel|rendezvous|_store_based_barrier|"
                        r"_new_process_group_helper|ProcessGroupGloo\(|connectFullMesh|init_device_mesh")),
    ("warmup", re.compile(r"_verify_param_shape_across_processes|_sync_module_states|_sync_params_and_buffers|"
                          r"DistributedDataParallel|warm_?up")),
)


def ranks_of(text: str) -> tuple[int, ...]:
    return tuple(sorted({int(t) for t in re.findall(r"\d+", text)}))


def stage_of(text: str) -> str | None:
    """The stage a frame, a path or a message points at (checkpoint, exit, init, warmup), or None."""
    for stage, pattern in STAGES:
        if pattern.search(text):
            return stage
    return None


def is_consequence(message: str) -> bool:
    return CONSEQUENCE.search(message) is not None


def store_key_rank(keys: str) -> int | None:
    """The rank a store wait names when every key it waited for is one rank's address in the default group."""
    found = {m.group("rank") for k in keys.split(", ") if (m := DEFAULT_KEY.match(k.strip()))}
    return int(found.pop()) if len(found) == 1 and len(keys.split(", ")) == 1 else None


def nccl_link(line: str) -> tuple[str, str] | None:
    """(this host, peer) of an NCCL WARN line that names the other end of a link."""
    m = NCCL_WARN.match(line)
    if m is None:
        return None
    peer = NCCL_PEER.search(m.group("msg"))
    return (m.group("host"), peer.group("peer")) if peer else None
