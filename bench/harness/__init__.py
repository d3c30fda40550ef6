"""The end-to-end benchmark's harness (``python bench/e2e.py``), built on the demo's pieces
(``pyasync.demo``).

Import it with ``bench/`` on ``sys.path`` (a script run as ``python bench/SCRIPT.py`` has it; bench/_path.py
adds the source tree; the tests insert it): its modules import the link emulator as ``linkemu``, and
spawned workers find ``harness`` through the inherited ``sys.path``.

- ``workload``: the wide model and its teacher task, MODELS, DDP hooks and hivemind as systems, the
  optimizer every system steps (``make_optimizer``), BenchConfig;
- ``seqtask``, ``lmtask``: the seq (sorting) and lm (a small GPT on generated arithmetic) workloads;
- ``slowdowns``: seeded transient slowdowns on top of the demo's straggler;
- ``ddp``: DDP's communication hook (all-reduce, fp16, PowerSGD) with byte counts and link time;
- ``train``: one run on one rank (the demo's loop with the benchmark's systems), calibration, local runs;
- ``scenarios``: the scenarios and default system lists;
- ``summary``: time to target, ratios against DDP, the summary table;
- ``plots``: accuracy against time and throughput per model;
- ``launch``: how every benchmark starts its ranks (a store on a port the OS picks, spawned processes,
  bounded collection of their results; Note [One launcher]);
- ``cli``: ``--systems``, the one option for what to run, with its old spellings as aliases, and the
  one parser of system specs (Note [One name for what to run]).
"""
