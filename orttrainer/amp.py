"""Loss scalers for mixed-precision training (legacy ``amp.loss_scaler`` semantics)."""


class LossScaler:
    """Base class of loss scalers: holds the current scale and its initial value.

    Subclasses implement :meth:`update`, called by the trainer after every optimizer
    boundary step of a mixed-precision run, and return the new scale.
    """

    def __init__(self, loss_scale):
        self._check_scale(loss_scale)
        self._input_name = None
        self._loss_scale = float(loss_scale)
        self._initial_loss_scale = float(loss_scale)

    @staticmethod
    def _check_scale(loss_scale):
        assert isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool) and loss_scale > 0, (
            f"'loss_scale' must be a positive number, got {loss_scale!r}"
        )

    @property
    def input_name(self):
        return self._input_name

    @input_name.setter
    def input_name(self, input_name):
        assert input_name is None or isinstance(input_name, str), "'input_name' must be a string"
        self._input_name = input_name

    @property
    def loss_scale(self):
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, loss_scale):
        self._check_scale(loss_scale)
        self._loss_scale = float(loss_scale)

    def reset(self):
        """Restore the initial loss scale."""
        self._loss_scale = self._initial_loss_scale

    def update(self, train_step_info):
        """Return the loss scale to use from now on, given the finished step."""
        raise NotImplementedError


class DynamicLossScaler(LossScaler):
    """Halve the scale on overflow; double it after ``up_scale_window`` finite steps.

    With ``automatic_update=False`` the scale never changes (static loss scaling).
    """

    def __init__(
        self,
        automatic_update=True,
        loss_scale=float(1 << 16),
        up_scale_window=2000,
        min_loss_scale=1.0,
        max_loss_scale=float(1 << 24),
    ):
        super().__init__(loss_scale)
        assert isinstance(automatic_update, bool), "'automatic_update' must be a bool"
        assert isinstance(up_scale_window, int) and up_scale_window > 0, "'up_scale_window' must be a positive int"
        assert isinstance(min_loss_scale, (int, float)) and min_loss_scale > 0, "'min_loss_scale' must be positive"
        assert isinstance(max_loss_scale, (int, float)) and max_loss_scale >= min_loss_scale, (
            "'max_loss_scale' must be at least 'min_loss_scale'"
        )
        self.automatic_update = automatic_update
        self.up_scale_window = up_scale_window
        self.min_loss_scale = float(min_loss_scale)
        self.max_loss_scale = float(max_loss_scale)
        self._stable_steps_count = 0

    def reset(self):
        super().reset()
        self._stable_steps_count = 0

    def update(self, train_step_info):
        if not self.automatic_update:
            return self.loss_scale
        if train_step_info.all_finite:
            self._stable_steps_count += 1
            if self._stable_steps_count >= self.up_scale_window:
                self.loss_scale = min(self.max_loss_scale, self.loss_scale * 2)
                self._stable_steps_count = 0
        else:
            self.loss_scale = max(self.min_loss_scale, self.loss_scale / 2)
            self._stable_steps_count = 0
        return self.loss_scale
