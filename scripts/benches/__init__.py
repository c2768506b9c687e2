"""What the benchmark scripts import beside bench_lib: one module per subcommand of the family scripts
(bench_train.py: train_*, bench_serve.py: serve_*, bench_topk.py: topk_*), each with `main(argv, prog)`, and
bench_ops.py's side-by-side section (ops_peers)."""
