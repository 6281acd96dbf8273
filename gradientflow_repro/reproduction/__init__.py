"""The reproduction: the ablation ladder trained to the target (reproduce), its report (report, runs),
long jobs that continue where they stopped (progress), accuracy over the whole schedule
(convergence), the fault table (fault_report), the W&B report (wandb_report).

The library (trainer, comm, data, models, config) never imports this package."""
