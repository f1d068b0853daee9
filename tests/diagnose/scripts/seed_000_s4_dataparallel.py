import torch
import torch.nn as nn

# 创建模型
model = MyModel()

# 包装为 DataParallel
if torch.cuda.device_count() > 1:
    print(f"Using {torch.cuda.device_count()} GPUs!")
    model = nn.DataParallel(model)

model = model.cuda()

# 正常训练
output = model(input_data.cuda())
loss = criterion(output, targets.cuda())
loss.backward()
optimizer.step()
# ruff: noqa  (verbatim from the seed document, kept as written: it is a lint fixture)
