"""Experiment trackers beside TensorBoard: Weights & Biases and MLflow (optional extras).

Each receives the same scalars TensorBoard does, under the same names and steps (`lm loss`,
`learning-rate`, `loss-scale`, ...). Configured with Megatron Bridge's `LoggerConfig` names:
`wandb_project/wandb_exp_name/wandb_entity/wandb_save_dir` and
`mlflow_experiment/mlflow_run_name/mlflow_tracking_uri/mlflow_tags`.
"""

from __future__ import annotations


class WandbTracker:
    """The run of `GlobalState.wandb_logger` (`WANDB_MODE=offline` writes it to wandb_save_dir without a
    server); the state owns it and finishes it (`GlobalState.close_loggers`)."""

    def __init__(self, wandb_module):
        self.wandb = wandb_module

    def log(self, scalars: dict[str, float], step: int):
        self.wandb.log(scalars, step=step)

    def close(self):
        pass


class MlflowTracker:
    """An MLflow run in mlflow_experiment (a tracking server, or a `file://` store)."""

    def __init__(self, cfg):
        import mlflow

        lg = cfg.logger
        self.mlflow = mlflow
        if lg.mlflow_tracking_uri:
            mlflow.set_tracking_uri(lg.mlflow_tracking_uri)
        mlflow.set_experiment(lg.mlflow_experiment)
        self.run = mlflow.start_run(run_name=lg.mlflow_run_name, tags=dict(lg.mlflow_tags or {}))

    def log(self, scalars: dict[str, float], step: int):
        self.mlflow.log_metrics(scalars, step=step, synchronous=True)

    def close(self):
        self.mlflow.end_run()


def build_trackers(cfg, state) -> list:
    """The trackers the logger section names (on the rank that writes metrics, the last)."""
    lg = cfg.logger
    out: list[WandbTracker | MlflowTracker] = []
    if lg.wandb_project:
        out.append(WandbTracker(state.wandb_logger))
    if lg.mlflow_experiment:
        out.append(MlflowTracker(cfg))
    return out
