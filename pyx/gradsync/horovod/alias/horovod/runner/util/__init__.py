"""horovod.runner.util, provided by gradsync."""
