"""The reproduction: the ablation ladder trained over the whole schedule (reproduce), its report as
data (report: the document; measures, peers, model_check: its numbers; verdicts: its goals, each a
value) rendered by ``render/reproduction.py``, the runs (runs), long jobs that continue where they
stopped (progress), accuracy over the whole schedule (convergence), the fault table (fault_report),
the W&B report (wandb_report).

The library (trainer, comm, data, models, config) never imports this package."""
