"""Analyses of trained models: COCOS, counting the candidates that contribute to each query's gradient
(Bleeker & de Rijke, ECIR 2022), in :mod:`training.analysis.cocos`."""
