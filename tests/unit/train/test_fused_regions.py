

def test_the_engine_runs_its_forwards_in_the_regions_only_when_asked(models):
    _, model = models
    norm = regions(model)["rms_norm"][0]
    for asked in (True, False):
        engine = TrainEngine(model, options=EngineOptions(compile_regions=asked))
        with engine.autocast():  # the block around every forward of compute_logprobs and update
            assert ("forward" in norm.__dict__) is asked
        assert "forward" not in norm.__dict__
