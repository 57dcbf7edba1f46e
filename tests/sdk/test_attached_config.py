"""run.init(config=...) inside a job: the run exists already, so its hyperparameters are
sent to be merged into the run's config (which holds the job's command line)."""
from sdkutil import TOKEN


def test_attached_init_sends_its_config(sdk, server, monkeypatch):
    monkeypatch.setenv("GPUCTL_RUN_ID", "5")
    monkeypatch.setenv("GPUCTL_SERVER", server.url)
    monkeypatch.setenv("GPUCTL_TOKEN", TOKEN)
    assert sdk.init(project="mnist", experiment="sweep", name="r1",
                    config={"lr": 0.1, "layers": [2, 3]}) == "5"
    sdk.log({"loss": 1.0}, step=1)
    assert sdk.flush(5)
    [(path, body)] = server.posts("/init")
    assert path == "/api/v1/runs/5/init"
    assert body == {"project": "mnist", "experiment": "sweep", "name": "r1",
                    "config": {"lr": 0.1, "layers": [2, 3]}}


def test_attached_init_without_config_sends_none(sdk, server, monkeypatch):
    monkeypatch.setenv("GPUCTL_RUN_ID", "5")
    monkeypatch.setenv("GPUCTL_SERVER", server.url)
    monkeypatch.setenv("GPUCTL_TOKEN", TOKEN)
    sdk.init()
    sdk.log({"loss": 1.0}, step=1)
    assert sdk.flush(5)
    assert server.posts("/init") == [] and server.posts("/config") == []
