from automodel.cli import console

console()
