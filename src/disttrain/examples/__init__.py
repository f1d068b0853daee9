"""The built-in jobs, as TrainTasks like any user's: what `disttrain run` trains when it is
given no script (digits) or `--example NAME` (short for the reference
`disttrain.examples.NAME:make_task`), to show and to test the Trainer. Their options are
their factories' arguments (`task_args`; the flags --data-dir, --download, --num-samples,
--input-size and --hidden-size map onto them where a task takes them).

- digits.py      make_task(hidden_size): SimpleNet on scikit-learn's bundled digits (the default)
- mnist.py       make_task(data_dir, download, hidden_size): SimpleNet on MNIST IDX files
- synthetic.py   make_task(num_samples, input_size, hidden_size): the benchmark workload
- seed002.py     make_task(num_samples, input_size): Linear(1000, 10) on random data (smoke)
- chargpt.py     make_task(block, layers, width, heads, dropout, stride, eval_fraction): a
                 character-level GPT on the Python documentation
- classify.py    accuracy and the TrainTask of the four classifiers
- models.py      SimpleNet, Seed002Net
- datasets.py    the datasets (offline unless download) and the warm fork server's copy
"""
